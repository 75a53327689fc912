"""Command start-up imports only what every run needs: DCP, dynamo, DeepSpeed, transformers, ONNX and the
other optional or heavy packages come in on the paths that use them (``benchmarks/startup.py`` times it).

A fresh interpreter per command: what ``import toolkit_cli.<cmd>`` leaves in ``sys.modules`` is what every
command, spawned rank and test process pays before its first line of work.
"""
from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO_ROOT
from tests.helpers.cli import subprocess_env

LAZY = ("torch.distributed.checkpoint", "torch.distributed.tensor", "torch._dynamo", "torch._inductor",
        "torch.distributed.fsdp", "deepspeed", "transformers", "safetensors", "onnx", "onnxruntime", "onnxscript",
        "tensorboard", "wandb", "lm_eval", "datasets", "omegaconf", "hydra")


def imported_after(*statements: str) -> list:
    """The LAZY modules in ``sys.modules`` after each statement (cumulative), in one fresh interpreter."""
    report = f"print(json.dumps(sorted(m for m in {LAZY!r} if m in sys.modules)))"
    code = "import json, sys\n" + "".join(f"{s}\n{report}\n" for s in statements)
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=subprocess_env(), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return [json.loads(line) for line in run.stdout.strip().splitlines()[-len(statements):]]


def test_a_command_imports_no_optional_or_heavy_module():
    commands = ["train", "eval_lm", "generate", "export", "validate", "interactive"]
    after = imported_after(*(f"import toolkit_cli.{c}" for c in commands))
    assert dict(zip(commands, after)) == {c: [] for c in commands}


def test_the_checkpoint_code_imports_dcp_at_its_first_use():
    """The lazy names are torch's own functions once called (the same results as importing them)."""
    imported, called = imported_after("import torch\nfrom toolkit.checkpoint import consolidated, sharded, safe_pickle",
                                      "from toolkit.checkpoint.dcp_state import StateDictOptions, set_model_state_dict\n"
                                      "m = torch.nn.Linear(2, 2)\n"
                                      "saved = {k: torch.zeros_like(v) for k, v in consolidated.model_state(m).items()}\n"
                                      "set_model_state_dict(m, saved, options=StateDictOptions(full_state_dict=True))\n"
                                      "assert set(saved) == {'weight', 'bias'} and not m.weight.any()")
    assert imported == [] and "torch.distributed.checkpoint" in called


def test_registering_every_component_and_building_models_on_meta_import_none():
    """``--help`` and every command register all components; eval-lm, generate and export build the model on
    the meta device (torch's default init of an embedding there would import dynamo)."""
    after = imported_after("from toolkit.core import registry\nregistry.import_all_components()",
                           "from toolkit import models\nmodels.build_on_meta('transformer_lm', 100, 64)\n"
                           "models.build_on_meta('transformer_lm', 100, 64, decoder_learned_pos=True)\n"
                           "models.build_on_meta('llama', 100, 64, decoder_layers=2, decoder_embed_dim=32, "
                           "decoder_attention_heads=2, decoder_ffn_embed_dim=64)")
    assert after == [[], []]
