"""--ema-seed-model (fairseq's EMAConfig): the moving average starts at another checkpoint's saved average.

fairseq reads ``extra_state["ema"]`` of the seed checkpoint (``load_ema_from_checkpoint``) into its
EMA model with ``strict=True``. The fairseq-layout checks use files built from fairseq's documented
key names and fairseq's forward pass as the reference; the toolkit check follows fairseq's EMA formula
from the seed through one real update.
"""

from __future__ import annotations

import os

import torch

from tests.helpers.cli import train


def test_toolkit_run_seeded_from_another_runs_average(tmp_path, wikitext_dir):
    from tests.helpers.lm_fixtures import make_wikitext_data_bin

    data_bin = str(tmp_path / "bin")
    make_wikitext_data_bin(data_bin, wikitext_dir, max_train_lines=300, max_valid_lines=20)
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    train(data_bin, first, "--max-update", "2", "--store-ema", "--ema-decay", "0.5", "--disable-validation")
    seed = torch.load(os.path.join(first, "checkpoint_last.pt"), weights_only=True)["extra_state"]["ema"]
    run = train(
        data_bin,
        second,
        "--max-update",
        "1",
        "--store-ema",
        "--ema-decay",
        "0.5",
        "--disable-validation",
        "--seed",
        "7",
        "--ema-seed-model",
        os.path.join(first, "checkpoint_last.pt"),
    )
    assert "EMA seeded from the moving average" in run.stdout + run.stderr
    ckpt = torch.load(os.path.join(second, "checkpoint_last.pt"), weights_only=True)
    for key, avg in ckpt["extra_state"]["ema"].items():  # fairseq's step: 0.5 * seed + 0.5 * weights after update 1
        torch.testing.assert_close(avg, 0.5 * seed[key] + 0.5 * ckpt["model"][key], rtol=1e-6, atol=1e-7)


def test_finetune_with_store_ema_continues_the_checkpoints_average(tmp_path, wikitext_dir):
    """fairseq's Trainer.load_checkpoint: under --store-ema a loaded checkpoint's saved average is the EMA's
    start (fine-tuning included); a checkpoint without one restarts it from the loaded weights."""
    from tests.helpers.lm_fixtures import make_wikitext_data_bin

    data_bin = str(tmp_path / "bin")
    make_wikitext_data_bin(data_bin, wikitext_dir, max_train_lines=300, max_valid_lines=20)
    first, plain = str(tmp_path / "first"), str(tmp_path / "plain")
    train(data_bin, first, "--max-update", "2", "--store-ema", "--ema-decay", "0.5", "--disable-validation")
    train(data_bin, plain, "--max-update", "2", "--disable-validation")
    pretrained = os.path.join(first, "checkpoint_last.pt")
    saved = torch.load(pretrained, weights_only=True)["extra_state"]["ema"]
    tuned = str(tmp_path / "tuned")
    run = train(
        data_bin,
        tuned,
        "--max-update",
        "1",
        "--store-ema",
        "--ema-decay",
        "0.5",
        "--disable-validation",
        "--finetune-from-model",
        pretrained,
    )
    assert "Loading EMA from checkpoint" in run.stdout + run.stderr
    ckpt = torch.load(os.path.join(tuned, "checkpoint_last.pt"), weights_only=True)
    for key, avg in ckpt["extra_state"]["ema"].items():
        torch.testing.assert_close(avg, 0.5 * saved[key] + 0.5 * ckpt["model"][key], rtol=1e-6, atol=1e-7)

    start = torch.load(os.path.join(plain, "checkpoint_last.pt"), weights_only=True)["model"]
    tuned2 = str(tmp_path / "tuned2")
    run = train(
        data_bin,
        tuned2,
        "--max-update",
        "1",
        "--store-ema",
        "--ema-decay",
        "0.5",
        "--disable-validation",
        "--finetune-from-model",
        os.path.join(plain, "checkpoint_last.pt"),
    )
    assert "EMA not found in checkpoint" in run.stdout + run.stderr
    ckpt = torch.load(os.path.join(tuned2, "checkpoint_last.pt"), weights_only=True)
    for key, avg in ckpt["extra_state"]["ema"].items():
        torch.testing.assert_close(avg, 0.5 * start[key] + 0.5 * ckpt["model"][key], rtol=1e-6, atol=1e-7)
