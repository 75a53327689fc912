"""An imported model carries its conventions (issue 45, item 3): no convention flag is needed.

A random ``LlamaForCausalLM`` of 16 positions whose tokenizer puts BOS first, imported with ``toolkit-export
--from hf``:

- the import's logged fine-tune command holds no ``--add-bos-token``; ``toolkit-train`` started from the
  checkpoint without it (and without ``--tokens-per-sample``) takes the model's own BOS and sample length, one
  INFO line each, and logs the losses of the run given ``--add-bos-token --tokens-per-sample 16``, exactly; its
  checkpoints record the conventions, and eval-lm of both runs' checkpoints prints one perplexity;
  ``--no-add-bos-token`` is kept with one warning line and trains another model;
- docs/long_context.md's recipe runs as written at tiny scale, with its flags (YaRN 8x from 16 to 128 positions,
  document masks, context parallelism over 2 of 4 gloo ranks, FSDP2, bf16, checkpointing): ``toolkit-plan``,
  ``toolkit-train --finetune-from-model`` and ``toolkit-export --format hf`` (``rope_scaling`` yarn written back).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tests.helpers import dist_helpers as H  # noqa: E402
from tests.helpers.hf_llama import make_hf  # noqa: E402

UPDATES = 3


def binarize(root, dest, train, valid):
    """The import's binarize command on ``train`` and ``valid`` (text lines or JSON-lines records)."""
    ours = root / "ours"
    run = H.run_cli(
        "toolkit_cli.preprocess",
        ["--only-source", "--trainpref", str(train), "--validpref", str(valid), "--destdir", str(dest)]
        + ["--srcdict", str(ours / "dict.txt"), "--bpe", "hf_byte_bpe", "--bpe-model", str(ours / "tokenizer.json")],
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return str(dest)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(root, the import's fine-tune flags, its lines: text lines binarized with its command as root/bin)."""
    root = tmp_path_factory.mktemp("conventions")
    make_hf(str(root / "hf"), "llama", max_position_embeddings=16, rope_scaling=None)
    run = H.run_cli("toolkit_cli.export", ["--from", "hf", "--path", str(root / "hf"), "--out", str(root / "ours")])
    assert run.returncode == 0, run.stderr[-2000:]
    flags = re.search(r"fine-tune with: toolkit-train DATA (.*)$", run.stdout + run.stderr, re.M).group(1).split()
    rng = np.random.default_rng(0)
    lines = [" ".join(f"w{i}" for i in rng.integers(0, 60, rng.integers(5, 30))) for _ in range(120)]
    (root / "train.txt").write_text("\n".join(lines[:100]) + "\n")
    (root / "valid.txt").write_text("\n".join(lines[100:]) + "\n")
    binarize(root, root / "bin", root / "train.txt", root / "valid.txt")
    return root, flags, lines


def without(flags, name):
    """``flags`` without ``name`` and its value."""
    at = flags.index(name)
    return flags[:at] + flags[at + 2 :]


def finetune(root, flags, name, *extra):
    save_dir = root / name
    proc = H.run_train(
        [str(root / "bin"), *flags, *extra]
        + ["--save-dir", str(save_dir), "--optimizer", "adam", "--lr", "0.001", "--batch-size", "4"]
        + ["--max-update", str(UPDATES), "--seed", "3", "--cpu", "--num-workers", "0", "--disable-validation"]
        + ["--log-format", "json", "--log-interval", "1", "--no-epoch-checkpoints"],
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return H.losses(proc.stdout), proc.stdout + proc.stderr, save_dir


def perplexity(root, checkpoint):
    run = H.run_cli("toolkit_cli.eval_lm", [str(root / "bin"), "--path", str(checkpoint), "--gen-subset", "valid"])
    assert run.returncode == 0, run.stderr[-2000:]
    return re.search(r"Perplexity: (\S+)", run.stdout + run.stderr).group(1)


def test_an_imported_model_trains_and_evaluates_with_its_own_conventions(imported):
    import torch

    root, flags, _ = imported
    assert "--add-bos-token" not in flags and flags[flags.index("--tokens-per-sample") + 1] == "16"
    plain, log, plain_dir = finetune(root, without(flags, "--tokens-per-sample"), "plain")
    model = str(root / "ours" / "model.pt")
    assert f"--add-bos-token: the model's own convention, from {model}" in log
    assert f"--tokens-per-sample 16: the model's own convention, from {model}" in log
    flagged, _, flagged_dir = finetune(root, flags, "flagged", "--add-bos-token")
    assert sorted(plain) == list(range(1, UPDATES + 1)) and plain == flagged

    saved = torch.load(plain_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True, mmap=True)["cfg"]
    assert saved["add_bos_token"] is True and saved["tokens_per_sample"] == 16
    assert json.loads(saved["model_conventions"])["add_bos_token"] is True
    assert perplexity(root, plain_dir / "checkpoint_last.pt") == perplexity(root, flagged_dir / "checkpoint_last.pt")

    other, log, _ = finetune(root, flags, "no-bos", "--no-add-bos-token")
    warnings = [line for line in log.splitlines() if "| WARNING |" in line and "own convention" in line]
    assert len(warnings) == 1 and "--no-add-bos-token: differs from the model's own convention" in warnings[0]
    assert other != plain


def test_the_long_context_recipe_runs_as_written(imported, tmp_path):
    """docs/long_context.md's commands with its flags; the sizes shrunk (16 -> 128 positions, dp 2 x cp 2), its
    documents JSON-lines records of several lines."""
    root, flags, lines = imported
    for name, part in (("long.jsonl", lines[:100]), ("long_valid.jsonl", lines[100:])):
        records = ["\n".join(part[i : i + 5]) for i in range(0, len(part), 5)]
        (tmp_path / name).write_text("".join(json.dumps({"text": r}) + "\n" for r in records))
    data = binarize(root, tmp_path / "long", tmp_path / "long.jsonl", tmp_path / "long_valid.jsonl")
    long = [f for f in without(without(flags, "--tokens-per-sample"), "--max-target-positions")]
    long = long[: long.index("--finetune-from-model")] + [
        *("--rope-scaling", "yarn", "--rope-scaling-factor", "8", "--rope-original-max-positions", "16"),
        *("--max-target-positions", "128", "--tokens-per-sample", "128", "--document-attention-mask"),
        *("--reset-position-ids", "--batch-size", "1", "--update-freq", "4", "--distributed-world-size", "4"),
        *("--context-parallel-size", "2", "--ddp-backend", "fully_sharded", "--bf16", "--checkpoint-activations"),
    ]
    plan = H.run_cli("toolkit_cli.plan", [*long, "--gpu", "h100"])
    assert plan.returncode == 0 and "FITS" in plan.stdout, plan.stdout[-2000:] + plan.stderr[-2000:]
    model = str(root / "ours" / "model.pt")
    train = H.run_train(
        [data, *long, "--sample-break-mode", "none", "--finetune-from-model", model, "--optimizer", "adam"]
        + ["--lr", "1e-5", "--lr-scheduler", "cosine", "--warmup-updates", "1", "--max-update", "2"]
        + ["--save-dir", str(tmp_path / "checkpoints")],
        timeout=900,
    )
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert "error" not in train.stderr.lower() and sorted(H.losses(train.stdout, "train")) in ([], [2])
    out = tmp_path / "long-hf"
    export = H.run_cli(
        "toolkit_cli.export",
        ["--path", str(tmp_path / "checkpoints" / "checkpoint_best.pt"), "--format", "hf", "--out", str(out)],
    )
    assert export.returncode == 0, export.stderr[-2000:]
    config = json.loads((out / "config.json").read_text())
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    assert scaling["rope_type"] == "yarn" and scaling["factor"] == 8.0 and config["max_position_embeddings"] == 128
