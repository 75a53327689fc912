"""docs/long_context.md's commands at the recipe's own sizes (32768 tokens, 8 ranks, CP 4, an 8B model).

The commands are read from the document itself, so the test follows it when it changes:

- ``toolkit-plan $LONG --gpu h100 --host-memory 2TiB`` exits 0 and prints FITS;
- ``toolkit-train data-bin/long $LONG ... --finetune-from-model model.pt`` resolves as written (nothing refused,
  no convention flag needed) for a checkpoint imported from a model without BOS (Qwen3's convention) and from
  one whose tokenizer puts BOS first (Llama's): the model's BOS is then the context each 32768-token block is
  read from, so --tokens-per-sample 32768 fits --max-target-positions 32768. Resolving builds no model; the
  tiny run of the same commands is tests/integration/test_imported_conventions.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest
import torch

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "long_context.md")


def recipe_commands():
    """The document's commands with ``$LONG`` expanded: {program: argv}."""
    text = open(DOC, encoding="utf-8").read()
    block = re.search(r"## The commands.*?```bash\n(.*?)```", text, re.S).group(1)
    lines = block.replace("\\\n", " ").splitlines()
    long = shlex.split(re.search(r'^LONG="(.*)"$', next(l for l in lines if l.startswith("LONG="))).group(1))
    commands = {}
    for line in lines:
        words = shlex.split(line.split("#", 1)[0])
        if words and words[0].startswith("toolkit-"):
            commands.setdefault(words[0], [a for w in words[1:] for a in (long if w == "$LONG" else [w])])
    return commands


def imported_checkpoint(folder, add_bos_token: bool, positions: int = 4096):
    """What ``toolkit-export --from hf`` writes for the run to start from: a data-bin's tokenizer vocabulary
    (BOS its own id, or EOS's where the tokenizer has none) and a checkpoint recording the model's conventions."""
    from toolkit.data.dictionary import Dictionary
    from toolkit.models.hf_checkpoint import model_conventions

    os.makedirs(folder / "data-bin", exist_ok=True)
    symbols = ["<s>", "<pad>", "</s>", "<unk>"] + [f"w{i}" for i in range(60)]
    bos = 0 if add_bos_token else 2
    Dictionary.from_vocabulary(symbols, bos=bos, pad=1, eos=2, unk=3).save(str(folder / "data-bin" / "dict.txt"))
    cfg = {"add_bos_token": add_bos_token, "tokens_per_sample": min(positions, 2048), "max_target_positions": positions}
    torch.save({"cfg": {**cfg, "model_conventions": model_conventions(cfg)}}, folder / "model.pt")
    return str(folder / "data-bin"), str(folder / "model.pt")


def test_the_plan_fits_as_written():
    """The plan of the command as given (toolkit-plan's verdict line; its layout search is tested elsewhere)."""
    from toolkit.plan.hardware import hardware_from_args, split_hardware_args
    from toolkit.plan.planner import make_plan
    from toolkit.train.arguments import parse_train_args
    from toolkit.train.resolve import resolve_and_log

    hardware, train_flags = split_hardware_args(recipe_commands()["toolkit-plan"])
    assert train_flags.count("32768") == 2 and hardware.host_memory
    plan = make_plan(resolve_and_log(*parse_train_args(train_flags, "toolkit-plan")), hardware_from_args(hardware))
    assert plan.fits and plan.setup.world == 8 and plan.setup.cp == 4


@pytest.mark.parametrize("add_bos_token", [False, True], ids=["qwen3", "llama"])
def test_the_training_command_resolves_at_its_sizes(tmp_path, add_bos_token, caplog):
    from toolkit.train.resolve import parse_train_config

    data, model = imported_checkpoint(tmp_path, add_bos_token)
    argv = recipe_commands()["toolkit-train"]
    argv = [data if a == "data-bin/long" else model if a.endswith("model.pt") else a for a in argv]
    assert "--add-bos-token" not in argv and argv.count("32768") == 2
    with caplog.at_level("INFO", logger="toolkit.resolve"):
        cfg = parse_train_config(argv + ["--save-dir", str(tmp_path / "checkpoints")])
    assert cfg.task.tokens_per_sample == 32768 and cfg.model.max_target_positions == 32768
    assert cfg.task.add_bos_token is add_bos_token  # the model's own convention, given by no flag
    assert json.loads(cfg.checkpoint.model_conventions)["add_bos_token"] is add_bos_token
    lines = [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "convention" in r.getMessage()]
    assert any("--max-target-positions 32768: differs" in m and "extended by the RoPE flags" in m for m in lines)
