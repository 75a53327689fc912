"""Training the DeepSeek-V3 family with toolkit-train (``deepseek_v3_tiny``: latent attention, the first layer
dense, 8 experts in 2 groups with the correction bias moving, a shared expert) on two gloo ranks, as one process
with --update-freq 2 trains it: with --expert-parallel-size 2 (each rank 4 of each layer's experts), and with
--context-parallel-size 2 (each rank's queries over the latents and rotary keys gathered from both, the routers'
statistics over the whole sequences). Each logs the same losses (the logged digits, 1e-4 relative) and router
terms, ends with the same correction biases, and its consolidated checkpoint holds the same weights (fp32, rtol
1e-4). Every run trains one multi-token prediction depth (``--mtp-depth 1``), whose loss is logged apart
and compared too; 2 FSDP2 ranks are compared as well, 2 ranks pp 2, 4 ranks pp 2 x cp 2 and 4 ranks pp 2 x tp 2
(the depth on the last stage with a copy of the embedding, the two copies' gradients summed, the norm counting one;
the gradient norms compared too), and 4 ranks of TP 2 x FSDP2 2 (the depth's block split as the decoder's; the gradient norms compared
too). The MoE families' training harness (``tests/helpers/moe_train.py``) runs them."""

import math
import re

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers.dist_helpers import assert_logged_losses_match
from tests.helpers.moe_train import UPDATES, assert_router_terms_match, logged, train

pytestmark = pytest.mark.integration

PLAIN = ["--arch", "deepseek_v3_tiny", "--max-update", str(UPDATES)]  # the last --arch given counts
# one multi-token prediction depth in the runs of LAYOUTS (its loss logged and compared)
DEEPSEEK = PLAIN + ["--mtp-depth", "1", "--mtp-loss-coef", "0.3"]
# 4 ranks: tp 2 x FSDP2 over 2 data-parallel replicas (the one process at --update-freq 2)
TENSOR_PARALLEL = ["--distributed-world-size", "4", "--model-parallel-size", "2", "--ddp-backend", "fully_sharded"]
PIPELINE = ["--distributed-world-size", "2", "--pipeline-parallel-size", "2", "--update-freq", "2"]
PIPELINE += ["--pipeline-schedule", "gpipe", "--pipeline-microbatches", "1"]
PIPELINE_CP = ["--distributed-world-size", "4", "--pipeline-parallel-size", "2", "--context-parallel-size", "2"]
PIPELINE_CP += ["--ddp-backend", "fully_sharded", "--update-freq", "2", *PIPELINE[-4:]]
PIPELINE_TP = ["--distributed-world-size", "4", "--pipeline-parallel-size", "2", "--model-parallel-size", "2"]
PIPELINE_TP += ["--update-freq", "2", *PIPELINE[-4:]]
LAYOUTS = {
    "expert_parallel_2": ["--distributed-world-size", "2", "--expert-parallel-size", "2"],
    "context_parallel_2": ["--distributed-world-size", "2", "--context-parallel-size", "2", "--update-freq", "2"],
    "fsdp2_2": ["--distributed-world-size", "2", "--ddp-backend", "fully_sharded"],
    # the depth and a copy of the embedding on the last stage (their gradients summed with the first stage's), one
    # micro-batch a batch so that the routers' statistics are one process's sample's
    "pipeline_parallel_2": PIPELINE,
    "pipeline_parallel_2_context_parallel_2": PIPELINE_CP,
    # each stage split over its 2 tp ranks, sequence parallel: the last stage's copy of the embedding
    # vocabulary-parallel as the first's (each tp rank's rows summed with the same rows there), its MoE layers
    # sharded over the stage's ranks
    "pipeline_parallel_2_tensor_parallel_2": PIPELINE_TP,
}


def correction_bias(save_dir):
    state = torch.load(f"{save_dir}/checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    return torch.stack([state[f"layers.{i}.mlp.gate.expert_bias"] for i in (1, 2)])


def gnorms(run):
    """The gradient norms logged, one an update."""
    return [float(g) for g in re.findall(r'"gnorm": "([0-9.]+)"', run.stdout)]


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("deepseek_v3_train") / "bin"))


@pytest.fixture(scope="module")
def one_process(data_bin, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("one")
    return save_dir, train(data_bin, save_dir, *DEEPSEEK, "--update-freq", "2")


def test_multi_token_prediction_is_logged_apart(one_process):
    """One process, --mtp-depth 1: mtp_loss logged every update beside loss (the next token's cross-entropy alone,
    base 2; mtp_loss in nats, near it at the start); the depth's weights in the checkpoint (its block a MoE layer
    with its correction bias). That it learns: ``tests/unit/test_deepseek_v3.py``."""
    save_dir, run = one_process
    loss, terms = H.losses(run.stdout), logged(run.stdout)
    assert sorted(loss) == sorted(terms) == list(range(1, UPDATES + 1))
    for u in loss:
        assert abs(terms[u]["mtp_loss"] - loss[u] * math.log(2)) < 0.5, (u, terms[u], loss[u])
    state = torch.load(save_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    assert state["mtp.0.eh_proj.weight"].shape == (64, 128) and "mtp.0.layer.mlp.gate.expert_bias" in state


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_two_ranks_equal_one_process(data_bin, one_process, tmp_path, layout):
    one_dir, one = one_process
    ranks = train(data_bin, tmp_path, *DEEPSEEK, *LAYOUTS[layout])
    assert_logged_losses_match(H.losses(ranks.stdout), H.losses(one.stdout), range(1, UPDATES + 1))
    assert_router_terms_match(logged(ranks.stdout), logged(one.stdout))
    if layout.startswith("pipeline_parallel_2"):  # the embedding's two copies counted once in the norm
        assert len(gnorms(one)) == UPDATES and gnorms(ranks) == pytest.approx(gnorms(one), abs=2e-3)
    assert correction_bias(one_dir).abs().sum() > 0  # the bias moved
    torch.testing.assert_close(correction_bias(tmp_path), correction_bias(one_dir))
    saved = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    reference = torch.load(one_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    assert saved.keys() == reference.keys()
    for name, tensor in reference.items():  # fp32: the ranks sum in their order, which Adam's step magnifies
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=5e-5, msg=name)


def test_tensor_parallel_2_by_fsdp2_2_equals_one_process(data_bin, one_process, tmp_path):
    """Latent attention split by heads (q_b_proj and kv_b_proj column-parallel, o_proj row-parallel, the
    compressions whole: the query's on each rank's positions, the key/value's on the gathered sequence), sequence
    parallel, FSDP2 over the replicas; the depth's block split as the decoder's, its norms and joining projection
    replicated: the one process's losses, router terms (mtp_loss among them) and weights."""
    one_dir, one = one_process
    ranks = train(data_bin, tmp_path / "tp", *DEEPSEEK, *TENSOR_PARALLEL)
    gnorm = [gnorms(run) for run in (ranks, one)]
    assert len(gnorm[1]) == UPDATES and gnorm[0] == pytest.approx(gnorm[1], abs=2e-3)  # Adam hides a scaled gradient
    assert_logged_losses_match(H.losses(ranks.stdout), H.losses(one.stdout), range(1, UPDATES + 1))
    assert_router_terms_match(logged(ranks.stdout), logged(one.stdout))
    saved = torch.load(tmp_path / "tp" / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    reference = torch.load(one_dir / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    assert saved.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=5e-5, msg=name)  # fp32: TP sums in its order
