"""--task sft: the loss over trained tokens, normalized by the trained tokens of the whole update.

The first update (plain SGD, whose step is proportional to the gradient) is the same whether its conversations
come as one batch, as four micro-batches of one process (--update-freq 4) or spread over two ranks, although the
micro-batches hold very different numbers of trained tokens: a per-micro-batch mean would weigh them otherwise.
"""

import json
import os
import re

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers.chat import make_chat_data_bin, trained_targets, varied_conversations
from toolkit.data.sft_dataset import SFTDataset

TRAIN = varied_conversations(16)


@pytest.fixture(scope="module")
def chat_bin(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat") / "bin"
    make_chat_data_bin(folder, {"train": TRAIN, "valid": varied_conversations(4, seed=1)})
    return str(folder)


def sft_args(save_dir, *extra):
    args = [a if a != "language_modeling" else "sft" for a in H.model_args(str(save_dir))]
    sgd = ["--optimizer", "sgd", "--lr", "0.5", "--required-batch-size-multiple", "1", "--max-update", "1"]
    return [*args, *sgd, "--disable-validation", "--no-epoch-checkpoints", *extra]


def first_update(chat_bin, save_dir, *extra):
    run = H.run_train([chat_bin, *sft_args(save_dir, *extra)])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    weights = torch.load(save_dir / "checkpoint_last.pt", weights_only=True)["model"]
    return weights, run.stdout


def logged(stdout: str, key: str) -> float:
    """``key`` of the first update's train_inner line."""
    line = next(m for m in re.finditer(r"\| train_inner \| (\{.*\})\s*$", stdout, re.M))
    return float(json.loads(line.group(1))[key])


def test_first_update_is_the_same_over_micro_batches_and_ranks(chat_bin, tmp_path):
    one_batch, log = first_update(chat_bin, tmp_path / "one", "--batch-size", "16")
    micro, micro_log = first_update(chat_bin, tmp_path / "uf4", "--batch-size", "3", "--update-freq", "4")
    ranks, ranks_log = first_update(
        chat_bin,
        tmp_path / "ranks",
        "--batch-size",
        "3",
        "--update-freq",
        "2",
        "--distributed-world-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
    )
    for name, want in one_batch.items():
        for other in (micro, ranks):
            torch.testing.assert_close(other[name], want, rtol=1e-5, atol=1e-6, msg=name)
    samples = len(SFTDataset([os.path.join(chat_bin, "train")], pad=1, tokens_per_sample=32))
    for stdout in (log, micro_log, ranks_log):  # every conversation in the update (3 batches of 3 samples or less)
        assert logged(stdout, "wpb") == trained_targets(TRAIN) and logged(stdout, "bsz") == samples <= 9
