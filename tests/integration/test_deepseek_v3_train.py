"""Training the DeepSeek-V3 family with toolkit-train (``deepseek_v3_tiny``: latent attention, the first layer
dense, 8 experts in 2 groups with the correction bias moving, a shared expert): two gloo ranks with
--expert-parallel-size 2 log the same losses and router terms as one process with --update-freq 2 (the logged
digits, 1e-4 relative), end with the same correction biases, and their consolidated checkpoint holds the same
weights (fp32, rtol 1e-4). The MoE family's training harness (``test_moe_train``) runs both."""

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers.dist_helpers import assert_logged_losses_match
from tests.integration.test_moe_train import UPDATES, assert_router_terms_match, logged, train

pytestmark = pytest.mark.integration

DEEPSEEK = ["--arch", "deepseek_v3_tiny"]  # after the harness's own --arch: the last one given counts


def correction_bias(save_dir):
    state = torch.load(f"{save_dir}/checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    return torch.stack([state[f"layers.{i}.mlp.gate.expert_bias"] for i in (1, 2)])


def test_two_expert_parallel_ranks_equal_one_process(tmp_path):
    data_bin = H.make_lm_data_bin(str(tmp_path / "bin"))
    one = train(data_bin, tmp_path / "one", *DEEPSEEK, "--max-update", str(UPDATES), "--update-freq", "2")
    ep = ["--distributed-world-size", "2", "--expert-parallel-size", "2"]
    placed = train(data_bin, tmp_path / "ep", *DEEPSEEK, "--max-update", str(UPDATES), *ep)
    assert "expert parallel: 2 MoE layers' experts over 2 ranks" in placed.stdout + placed.stderr
    assert_logged_losses_match(H.losses(placed.stdout), H.losses(one.stdout), range(1, UPDATES + 1))
    assert_router_terms_match(logged(placed.stdout), logged(one.stdout))
    assert correction_bias(tmp_path / "ep").abs().sum() > 0  # the bias moved
    torch.testing.assert_close(correction_bias(tmp_path / "ep"), correction_bias(tmp_path / "one"))
    saved = torch.load(tmp_path / "ep" / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    reference = torch.load(tmp_path / "one" / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    assert saved.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
