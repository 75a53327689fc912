"""Command start-up imports only what every run needs: DCP, dynamo, DeepSpeed, transformers, ONNX and the
other optional or heavy packages come in on the paths that use them (``benchmarks/startup.py`` times it).

A fresh interpreter per command: what ``import toolkit_cli.<cmd>`` leaves in ``sys.modules`` is what every
command, spawned rank and test process pays before its first line of work.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.startup import LAZY
from tests.helpers import REPO_ROOT
from tests.helpers.cli import subprocess_env


def imported_after(*statements: str) -> list:
    """The LAZY modules in ``sys.modules`` after each statement (cumulative), in one fresh interpreter."""
    report = f"print(json.dumps(sorted(m for m in {LAZY!r} if m in sys.modules)))"
    code = "import json, sys\n" + "".join(f"{s}\n{report}\n" for s in statements)
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return [json.loads(line) for line in run.stdout.strip().splitlines()[-len(statements) :]]


def test_a_command_imports_no_optional_or_heavy_module():
    commands = [
        "train",
        "eval_lm",
        "generate",
        "export",
        "validate",
        "interactive",
        "plan",
        "hydra_train",
        "eval_harness",
        "consolidate",
        "preprocess",
    ]
    after = imported_after(*(f"import toolkit_cli.{c}" for c in commands))
    assert dict(zip(commands, after)) == {c: [] for c in commands}


def test_the_checkpoint_code_imports_dcp_at_its_first_use():
    """The lazy names are torch's own functions once called (the same results as importing them)."""
    imported, called = imported_after(
        "import torch\nfrom toolkit.checkpoint import consolidated, sharded, safe_pickle",
        "from toolkit.checkpoint.dcp_state import StateDictOptions, set_model_state_dict\n"
        "m = torch.nn.Linear(2, 2)\n"
        "saved = {k: torch.zeros_like(v) for k, v in consolidated.model_state(m).items()}\n"
        "set_model_state_dict(m, saved, options=StateDictOptions(full_state_dict=True))\n"
        "assert set(saved) == {'weight', 'bias'} and not m.weight.any()",
    )
    assert imported == [] and "torch.distributed.checkpoint" in called


def test_registering_every_component_and_building_models_on_meta_import_none():
    """``--help`` and every command register all components; eval-lm, generate and export build the model on
    the meta device (torch's default init of an embedding there would import dynamo)."""
    after = imported_after(
        "from toolkit.core import registry\nregistry.import_all_components()",
        "from toolkit import models\nmodels.build_on_meta('transformer_lm', 100, 64)\n"
        "models.build_on_meta('transformer_lm', 100, 64, decoder_learned_pos=True)\n"
        "models.build_on_meta('llama', 100, 64, decoder_layers=2, decoder_embed_dim=32, "
        "decoder_attention_heads=2, decoder_ffn_embed_dim=64)",
    )
    assert after == [[], []]


def test_initializing_a_model_in_one_process_imports_no_dtensor():
    """``init_weights`` asks every parameter whether it is a DTensor (``core.dtensor.is_dtensor``): in one
    process there is none, and asking imports no torch.distributed.tensor (its sharding ops cost about as much
    CPU as half of ``import torch``); a real DTensor is still recognized once its module is there."""
    initialized, sharded = imported_after(
        "import torch\nfrom toolkit import models\nfrom toolkit.core import registry\n"
        "from toolkit.models.init import init_weights\nregistry.import_all_components()\n"
        "m = models.build_on_meta('transformer_lm', 100, 64, decoder_layers=1, decoder_embed_dim=16, "
        "decoder_ffn_embed_dim=32, decoder_attention_heads=2, decoder_input_dim=16, decoder_output_dim=16)\n"
        "m.to_empty(device='cpu')\ninit_weights(m, seed=1)\n"
        "assert m.embed_tokens.weight.abs().sum() > 0",
        "import os, tempfile, torch.distributed as dist\nfrom toolkit.core.dtensor import is_dtensor\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor import Replicate, distribute_tensor\n"
        "dist.init_process_group('gloo', init_method='file://' + tempfile.mktemp(), rank=0, world_size=1)\n"
        "t = distribute_tensor(torch.ones(2), init_device_mesh('cpu', (1,)), [Replicate()])\n"
        "assert is_dtensor(t) and not is_dtensor(t.to_local())\ndist.destroy_process_group()",
    )
    assert "torch.distributed.tensor" not in initialized and "torch.distributed.tensor" in sharded


def modules_after_command(command: str, argv: list) -> tuple:
    """(exit status, whether torch or numpy was imported) of ``toolkit-<command> ARGV`` in one fresh interpreter."""
    code = (
        "import importlib, sys\n"
        f"command = importlib.import_module('toolkit_cli.{command}')\n"
        f"sys.argv = ['toolkit-{command}'] + {list(argv)!r}\n"
        "try:\n    command.cli_main()\n    status = 0\n"
        "except SystemExit as e:\n    status = e.code\n"
        "print('RESULT', status, 'torch' in sys.modules or 'numpy' in sys.modules, file=sys.stderr)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    result = [line for line in run.stderr.splitlines() if line.startswith("RESULT ")]
    assert result, run.stderr[-2000:]
    _, status, torch_imported = result[-1].split()
    return int(status or 0), torch_imported == "True"


HELP_AND_ARGUMENT_ERRORS = [
    ("train", ["--help"], 0),
    ("train", ["--arch", "llama_tiny", "--help"], 0),
    ("train", ["--arch", "moe_tiny", "--optimizer", "muon", "--lr-scheduler", "wsd", "--help"], 0),
    ("train", ["data-bin", "--arch", "no_such_arch"], 1),
    ("train", ["data-bin", "--lr", "abc"], 1),
    ("train", ["data-bin", "--optimizer", "no_such_optimizer"], 1),
    ("train", ["data-bin", "--no-such-flag"], 1),
    ("train", ["data-bin", "--arch", "llama_tiny", "--dropout", "0.1"], 1),
    ("eval_lm", ["--help"], 0),
    ("eval_lm", ["data-bin", "--path", "x.pt", "--batch-size", "abc"], 1),
    ("preprocess", ["--help"], 0),
    ("preprocess", ["--bpe", "sentencepiece", "--help"], 0),
    ("preprocess", ["--bpe", "no_such_bpe"], 1),
    ("generate", ["--help"], 0),
    ("generate", ["data-bin", "--beam", "abc"], 1),
    ("interactive", ["--help"], 0),
    ("interactive", ["data-bin", "--sampling-topp", "xyz"], 1),
    ("validate", ["--help"], 0),
    ("validate", ["data-bin", "--path", "x.pt", "--batch-size", "abc"], 1),
    ("export", ["--help"], 0),
    ("export", ["--path", "x.pt", "--format", "no_such_format"], 1),
    ("export", ["--path", "x.pt", "--dtype", "fp8"], 1),
    ("plan", ["--help"], 0),
    ("plan", ["--gpu", "no_such_gpu"], 1),
    ("plan", ["--gpu-memory", "12XB"], 1),
    ("plan", ["--arch", "no_such_arch"], 1),
    ("plan", ["--lr", "abc"], 1),
    ("hydra_train", ["--help"], 0),
    ("hydra_train", ["--no-such-flag"], 1),
    ("hydra_train", ["task.data=data-bin", "optimization.max_update=abc"], 1),
    ("hydra_train", ["task.data=data-bin", "no_such_group.x=1"], 1),
    ("eval_harness", ["--help"], 0),
    ("eval_harness", ["--path", "x.pt", "--limit", "-3"], 1),
    ("consolidate", ["--help"], 0),
    ("consolidate", ["checkpoints/x", "--no-such-flag"], 1),
]


@pytest.mark.parametrize(
    "command,argv,status", HELP_AND_ARGUMENT_ERRORS, ids=[f"{c} {' '.join(a)}" for c, a, _ in HELP_AND_ARGUMENT_ERRORS]
)
def test_help_and_argument_errors_exit_before_torch_is_imported(command, argv, status):
    """The parser is built from the components' names and options alone (``registry.BUILTIN_COMPONENTS``,
    torch-free options modules); torch and numpy come in after parsing, with the code that runs the command."""
    assert modules_after_command(command, argv) == (status, False)


def test_a_bad_model_option_value_is_the_commands_own_error_line(capsys):
    """The model options are parsed once for the arch's defaults before the full parse: a bad value there is
    the command's one line (it was "train.py: error: ...", the interpreter's script name)."""
    from toolkit.train.arguments import parse_train_args

    with pytest.raises(SystemExit) as e:
        parse_train_args(["data-bin", "--dropout", "zz"], prog="toolkit-hydra-train")
    assert e.value.code == 1
    assert capsys.readouterr().err.strip() == "toolkit-hydra-train: error: argument --dropout: invalid number: 'zz'"


VALID_COMMAND_LINES = [
    ("eval_lm", ["data-bin-that-is-not-there", "--path", "no_such.pt"], 1),
    ("export", ["--path", "no_such.pt", "--format", "safetensors", "--out", "no_such_export_folder"], 1),
    ("consolidate", ["no_such_checkpoint_folder"], 1),
    ("plan", ["--arch", "transformer_lm", "--vocab-size", "1000"], 0),
    ("hydra_train", ["task.data=data-bin-that-is-not-there", "model=transformer_lm"], 1),
    ("eval_harness", ["--path", "no_such.pt", "--tasks", "t", "--include-path", "no_such_task_folder"], 1),
]


@pytest.mark.parametrize(
    "command,argv,status", VALID_COMMAND_LINES, ids=[f"{c} {' '.join(a)}" for c, a, _ in VALID_COMMAND_LINES]
)
def test_a_valid_command_line_goes_on_to_import_torch(command, argv, status):
    """The check above can fail: past parsing, each command imports torch (here failing on a missing
    checkpoint, data or task folder; toolkit-plan fits its run)."""
    assert modules_after_command(command, argv) == (status, True)


def test_eval_harness_without_lm_eval_says_what_to_install():
    """lm-eval is an optional extra: without it, one line naming the pip install (exit 1)."""
    code = (
        "import sys\nsys.modules['lm_eval'] = None  # what an interpreter without lm-eval finds\n"
        "sys.argv = ['toolkit-eval-harness', '--path', 'x.pt', '--tasks', 't']\n"
        "from toolkit_cli import eval_harness\neval_harness.cli_main()\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 1, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1] == (
        "toolkit-eval-harness: error: lm-eval is not installed; pip install lm-eval (or: pip install toolkit[eval])"
    )


def test_the_declared_components_are_what_the_modules_register():
    """Every built-in name is declared with the module that registers it and the options class it registers
    with (a fresh interpreter: what the packages register, no test's plugin); a component a module registered
    without a declaration would be missing from the command line."""
    code = """
import importlib, json
from toolkit.core import registry
registry.import_all_components()
problems = []
for reg, declared in registry.BUILTIN_COMPONENTS.items():
    problems += [f"{reg.kind} {name}: not declared" for name in set(reg.entries) - set(declared)]
    for name, (module, options) in declared.items():
        entry = reg.get(name)
        options_module, _, options_class = options.partition(":")
        if entry.module != module or entry.cls is None:
            problems.append(f"{reg.kind} {name}: registered by {entry.module}, declared {module}")
        if getattr(importlib.import_module(options_module), options_class) is not entry.config:
            problems.append(f"{reg.kind} {name}: options {entry.config}, declared {options}")
print(json.dumps(problems))
"""
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == []
