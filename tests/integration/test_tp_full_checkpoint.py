"""A consolidated (.pt) checkpoint saved by one process resumes under --model-parallel-size 2 x FSDP2 (4 gloo ranks)
with a vocabulary the tensor-parallel ranks cannot split evenly (45 entries: 23 + 22 rows, as a fresh run splits it).

It used to fail inside torch's ``distribute_tensor`` (FSDP2-over-TP's ``_StridedShard`` refuses an uneven dimension
when scattering from rank 0); every rank now cuts its own shards of the whole file, as ``init_weights`` does. Both
the model (``--finetune-from-model``) and the optimizer state (``--restore-file``) are checked, against the same
resume in one process (same batches: --update-freq 2), loss for loss.
"""

from __future__ import annotations

import pytest

from tests.helpers.cli import run_cli
from tests.helpers.dist_helpers import assert_logged_losses_match
from tests.helpers.lm_fixtures import make_data_bin

WORDS = [f"w{i}" for i in range(41)]
MODEL = [
    "--task",
    "language_modeling",
    "--arch",
    "transformer_lm_gpt3_small",
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "32",
    "--decoder-ffn-embed-dim",
    "64",
    "--decoder-attention-heads",
    "2",
    "--dropout",
    "0",
    "--optimizer",
    "adam",
    "--lr",
    "0.003",
    "--tokens-per-sample",
    "16",
    "--seed",
    "3",
    "--num-workers",
    "0",
    "--cpu",
    "--log-format",
    "json",
    "--log-interval",
    "1",
    "--disable-validation",
    "--no-epoch-checkpoints",
]
TP = [
    "--batch-size",
    "2",
    "--model-parallel-size",
    "2",
    "--distributed-world-size",
    "4",
    "--ddp-backend",
    "fully_sharded",
]
ONE = ["--batch-size", "2", "--update-freq", "2"]


@pytest.fixture(scope="module")
def odd_vocab(tmp_path_factory):
    lines = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(30)) for i in range(60)]
    dest = tmp_path_factory.mktemp("odd_vocab") / "bin"
    dictionary = make_data_bin(dest, {"train": lines, "valid": lines[:4]}, padding_factor=1)
    assert len(dictionary) % 2 == 1
    return str(dest)


def _train(data, save_dir, *flags):
    run = run_cli("toolkit_cli.train", [data, *MODEL, "--save-dir", str(save_dir), *flags], timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def saved(odd_vocab, tmp_path_factory):
    """Two updates in one process, written as one consolidated checkpoint."""
    save_dir = tmp_path_factory.mktemp("saved")
    _train(odd_vocab, save_dir, *ONE, "--max-update", "2")
    return str(save_dir / "checkpoint_last.pt")


@pytest.mark.parametrize("load", ["--finetune-from-model", "--restore-file"])
def test_full_checkpoint_resumes_under_tp_with_an_odd_vocabulary(odd_vocab, saved, tmp_path, load):
    updates = range(1, 3) if load == "--finetune-from-model" else range(3, 5)
    max_update = str(updates[-1])
    want = _train(odd_vocab, tmp_path / "one", *ONE, load, saved, "--max-update", max_update).losses()
    got = _train(odd_vocab, tmp_path / "tp", *TP, load, saved, "--max-update", max_update).losses()
    assert_logged_losses_match(got, want, updates)
