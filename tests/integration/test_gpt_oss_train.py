"""Training the gpt-oss family with toolkit-train (``gpt_oss_tiny``: sinks, a local layer of window 4 then a global
one, 4 biased experts of the clamped SwiGLU, top 2): one process's loss falls over its 4 updates, and two gloo ranks
train as one process with --update-freq 2 does: FSDP2 (``fully_sharded``) with --expert-parallel-size 2 (each rank
2 of each layer's experts, their biases with them). It logs the same losses (the logged digits, 1e-4 relative)
and router terms, and its consolidated checkpoint holds the same weights (fp32, rtol 1e-4). The MoE families'
training harness (``tests/helpers/moe_train.py``) runs them."""

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers.dist_helpers import assert_logged_losses_match
from tests.helpers.moe_train import UPDATES, assert_router_terms_match, logged, train

pytestmark = pytest.mark.integration

GPT_OSS = ["--arch", "gpt_oss_tiny", "--moe-bias-update-rate", "0", "--max-update", str(UPDATES)]  # the last counts
# FSDP2 over both ranks, each also holding 2 of each layer's 4 experts (expert parallelism over the same ranks)
FSDP2_EP2 = ["--distributed-world-size", "2", "--ddp-backend", "fully_sharded", "--expert-parallel-size", "2"]


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("gpt_oss_train") / "bin"))


@pytest.fixture(scope="module")
def one_process(data_bin, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("one")
    return save_dir, train(data_bin, save_dir, *GPT_OSS, "--update-freq", "2")


def test_one_process_loss_falls(one_process):
    losses = H.losses(one_process[1].stdout)
    assert sorted(losses) == list(range(1, UPDATES + 1)) and losses[UPDATES] < losses[1]


def test_two_fsdp2_ranks_with_expert_parallelism_equal_one_process(data_bin, one_process, tmp_path):
    one_dir, one = one_process
    ranks = train(data_bin, tmp_path, *GPT_OSS, *FSDP2_EP2)
    assert_logged_losses_match(H.losses(ranks.stdout), H.losses(one.stdout), range(1, UPDATES + 1))
    assert_router_terms_match(logged(ranks.stdout), logged(one.stdout))
    saved = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    reference = torch.load(one_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    assert saved.keys() == reference.keys()
    assert reference["layers.0.mlp.experts.down_proj_bias"].abs().sum() > 0  # the experts' biases trained
    for name, tensor in reference.items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
