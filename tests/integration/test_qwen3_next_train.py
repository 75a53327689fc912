"""Training the Qwen3-Next family with toolkit-train (``qwen3_next_tiny``: three gated DeltaNet layers and a gated
full-attention one, experts with a gated shared expert) with --context-parallel-size 2 on two gloo ranks, as one
process with --update-freq 2 trains it: each rank's two chunks (the load-balanced layout, chunks r and 3 - r of 4)
start from the recurrent state and convolution tail the earlier chunks leave (their affine maps all-gathered and
composed), so the losses logged are the same (the logged digits) and the last checkpoint holds the same weights
(fp32, rtol 1e-4); with --document-attention-mask the state restarts at each document inside and across the
chunks, as one process's."""

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers.dist_helpers import assert_logged_losses_match

pytestmark = pytest.mark.integration

UPDATES = 3
MASKS = {"plain": [], "documents": ["--document-attention-mask"]}
CP2 = ["--distributed-world-size", "2", "--context-parallel-size", "2"]


def train(data_bin, save_dir, *flags):
    argv = [data_bin, "--task", "language_modeling", "--arch", "qwen3_next_tiny", "--optimizer", "adam"]
    argv += ["--lr", "0.003", "--batch-size", "2", "--tokens-per-sample", "32", "--seed", "3", "--num-workers", "0"]
    argv += ["--cpu", "--log-format", "json", "--log-interval", "1", "--save-dir", str(save_dir)]
    argv += ["--disable-validation", "--max-update", str(UPDATES), "--no-epoch-checkpoints", *flags]
    proc = H.run_train(argv, timeout=300)
    assert proc.returncode == 0, f"toolkit-train failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def weights(save_dir):
    return torch.load(f"{save_dir}/checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("qwen3_next_train") / "bin"))


@pytest.mark.parametrize("mask", sorted(MASKS))
def test_context_parallel_2_equals_one_process(data_bin, tmp_path, mask):
    one = train(data_bin, tmp_path / "one", "--update-freq", "2", *MASKS[mask])
    ranks = train(data_bin, tmp_path / "cp2", *CP2, "--update-freq", "2", *MASKS[mask])
    assert_logged_losses_match(H.losses(ranks.stdout), H.losses(one.stdout), range(1, UPDATES + 1))
    saved, reference = weights(tmp_path / "cp2"), weights(tmp_path / "one")
    assert saved.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
