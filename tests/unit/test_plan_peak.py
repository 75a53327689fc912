"""toolkit.plan's update peak (what is alive at once in an update) against a measured update, in-process.

The measurement is ``toolkit.plan.measure.LivePeak``: every allocation and free torch's profiler
records, summed in time order. The bound is 15% (the issue allows 25% for activations); on this
model the plan is within 5% (fp32 +4.3%, checkpointed -1.8% to +0.9%). The previous formula (the sum
of every row) was 39-75% high with checkpointing; without the recomputed block the checkpointed
peak is 34-38% low: either regression fails here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.dist_helpers import make_lm_data_bin

MODEL = [
    "--task",
    "language_modeling",
    "--arch",
    "transformer_lm_gpt3_small",
    "--decoder-layers",
    "3",
    "--decoder-embed-dim",
    "128",
    "--decoder-ffn-embed-dim",
    "512",
    "--decoder-attention-heads",
    "2",
    "--dropout",
    "0",
    "--lr",
    "0.001",
    "--batch-size",
    "4",
    "--tokens-per-sample",
    "128",
    "--seed",
    "3",
    "--num-workers",
    "0",
    "--cpu",
    "--log-format",
    "none",
    "--no-save",
    "--disable-validation",
    "--optimizer",
    "adam",
]
TOLERANCE = 0.15


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_lm_data_bin(str(tmp_path_factory.mktemp("plan_peak") / "bin"))


def _cfg(data: str, *flags: str, model=MODEL):
    from toolkit.train.resolve import parse_train_config

    return parse_train_config([data, *model, *flags])


def _measured_and_planned(data: str, *flags: str, model=MODEL):
    """(the live peak of the second update on one process, the plan made from the same flags)."""
    from toolkit.distributed.utils import init_distributed
    from toolkit.plan import PRESETS, make_plan
    from toolkit.plan.measure import live_peak_of_update
    from toolkit.train.train_loop import build_trainer, train_iterator

    cfg = _cfg(data, *flags, model=model)
    env = init_distributed(cfg.distributed, cpu=True)
    torch.manual_seed(0)
    trainer = build_trainer(cfg, env, [cfg.dataset.train_subset])
    batches = train_iterator(cfg, trainer, epoch=1).next_epoch_itr(shuffle=False)
    measured = live_peak_of_update(trainer, batches)["live_peak"]
    return measured, make_plan(cfg, PRESETS["cpu"], world_size=1)


@pytest.mark.parametrize(
    "flags",
    [(), ("--checkpoint-activations",), ("--checkpoint-activations", "--bf16")],
    ids=["fp32", "fp32_ckpt", "bf16_ckpt"],
)
def test_update_peak_matches_a_measured_update(data, flags):
    measured, plan = _measured_and_planned(data, *flags)
    predicted = plan.update_peak.host
    assert abs(predicted - measured) <= TOLERANCE * measured, (flags, predicted, measured)


MOE = [
    "--task",
    "language_modeling",
    "--arch",
    "moe_tiny",
    "--decoder-layers",
    "3",
    "--moe-num-experts",
    "8",
    "--moe-top-k",
    "4",
    "--moe-ffn-embed-dim",
    "128",
    "--lr",
    "0.001",
    "--batch-size",
    "4",
    "--tokens-per-sample",
    "128",
    "--seed",
    "3",
    "--num-workers",
    "0",
    "--cpu",
    "--log-format",
    "none",
    "--no-save",
    "--disable-validation",
    "--optimizer",
    "adam",
]


@pytest.mark.parametrize(
    "flags",
    [(), ("--checkpoint-activations",), ("--checkpoint-activations", "--bf16")],
    ids=["fp32", "fp32_ckpt", "bf16_ckpt"],
)
def test_moe_update_peak_matches_a_measured_update(data, flags):
    """A mixture of experts (8 experts of 128, top 4: the dispatch's [N k, C] and [N k, F] rows are most of a
    layer) within the same 15%: measured +3.0%, -1.0%, -11.5%. Before the planner read the expert stacks as
    matmul weights (autocast's bf16 copies of them) and traced the fp32 grouped GEMM in its own dtype (not bf16
    rows and per-sequence bf16 copies of every expert), it was +15.1%, +8.1% and -15.9%."""
    measured, plan = _measured_and_planned(data, *flags, model=MOE)
    predicted = plan.update_peak.host
    assert plan.stats.moe_layers == 3 and plan.stats.moe_top_k == 4
    assert abs(predicted - measured) <= TOLERANCE * measured, (flags, predicted, measured)


def test_expert_stacks_split_over_expert_parallel_ranks_and_their_fsdp_peers(data):
    """--expert-parallel-size P: a rank keeps E/P experts; under FSDP2 they are sharded over the (dp_shard x cp) / P
    ranks holding the same ones (ParallelDims.mesh(*EXPERT_PEERS)), so their bytes per rank are E/S either way,
    while DDP keeps E/P whole; the dense part is unchanged."""
    from toolkit.plan.memory import local_shape
    from toolkit.plan.model_stats import model_stats
    from toolkit.plan.setup import setup_from_config

    cfg = _cfg(
        data,
        "--ddp-backend",
        "fully_sharded",
        "--distributed-world-size",
        "4",
        "--expert-parallel-size",
        "2",
        model=MOE,
    )
    stats, setup = model_stats(cfg, torch.float32), setup_from_config(cfg, gpu=True)
    expert = next(p for p in stats.params if p.expert)
    dense = next(p for p in stats.params if p.layer == 0 and not p.expert and len(p.shape) == 2)
    assert expert.shape[0] == 8 and expert.matmul
    assert local_shape(expert, 1, 4, ep=2)[0] == 2 and local_shape(expert, 1, 4, ep=1)[0] == 2
    assert local_shape(expert, 1, 1, ep=2)[0] == 4  # DDP: this rank's experts, whole
    assert local_shape(dense, 1, 4, ep=2) == local_shape(dense, 1, 4, ep=1)
    assert setup.ep == 2


def test_expert_parallel_adds_the_all_to_all_and_its_gradient_rows(data):
    """--expert-parallel-size 2: each MoE layer's exchanges appear in the step's collectives (token rows there and
    back, forward and backward, again for a checkpointed block's recompute) and its gradient rows in the backward's
    transient; none without EP."""
    from toolkit.plan import PRESETS, make_plan

    def plan(*flags):
        cfg = _cfg(data, "--ddp-backend", "fully_sharded", "--distributed-world-size", "2", "--bf16", *flags, model=MOE)
        return make_plan(cfg, PRESETS["h100"])

    plain, ep, ckpt = (
        plan(),
        plan("--expert-parallel-size", "2"),
        plan("--expert-parallel-size", "2", "--checkpoint-activations"),
    )
    a2a = lambda p: {name: nbytes for name, nbytes, _ in p.time.comm}.get("expert all-to-all", 0)  # noqa: E731
    rows = 4 * 128 * 4  # B x T x top k
    assert a2a(plain) == 0 and a2a(ep) == 3 * 2 * 2 * rows * 64 * 2 / 2
    assert a2a(ckpt) == a2a(ep) * 3 / 2
    transient = lambda p: next(i.gpu for i in p.items if i.name == "backward transient")  # noqa: E731
    from toolkit.plan.memory import expert_exchange

    assert expert_exchange(ep.stats, ep.setup) == 2 * rows * 64 * 2 and expert_exchange(plain.stats, plain.setup) == 0
    assert 0 < transient(ep) - transient(plain) <= 2 * rows * 64 * 2  # less where the logits' gradient was larger


def test_checkpointed_peak_is_at_the_first_block_and_counts_one_recomputed_block(data):
    """With checkpointing the peak is all gradients + one recomputed block, far above the saved inputs."""
    from toolkit.plan.update_peak import moments

    _, plan = _measured_and_planned(data, "--checkpoint-activations")
    assert plan.update_peak.where == "backward of the first block"
    b, act = plan.setup.batch_sequences, plan.stats.activations
    bottom = sum(n for n, _ in moments(plan.stats, plan.setup).bottom)
    grads = next(i.host for i in plan.items if i.name == "gradients")
    assert bottom >= grads + b * act.per_layer
    saved = next(i.host for i in plan.items if i.name == "activations (saved)")
    assert plan.update_peak.host < grads + saved + b * act.per_layer * 2  # not the old sum with two blocks


def test_shard_grad_op_keeps_every_block_gathered_until_backward(data):
    """--sharding-strategy shard_grad_op (reshard_after_forward=False) holds the whole model in the
    compute dtype at the start of backward; full_shard the root and two blocks."""
    from toolkit.plan.setup import setup_from_config
    from toolkit.plan.model_stats import model_stats
    from toolkit.plan.update_peak import moments

    cfg = _cfg(data, "--ddp-backend", "fully_sharded", "--distributed-world-size", "2", "--bf16")
    stats = model_stats(cfg, torch.bfloat16)
    full = setup_from_config(cfg, gpu=True)
    grad_op = dataclasses.replace(full, strategy="shard_grad_op", reshard=False)
    blocks = [p.numel for p in stats.params if p.layer is not None]
    block = sum(p.numel for p in stats.params if p.layer == 0)
    top = lambda s: sum(n for n, _ in moments(stats, s).top)  # noqa: E731
    assert top(grad_op) - top(full) == 2 * (sum(blocks) - 2 * block)


def test_plan_peak_is_persistent_rows_plus_the_update_peak(data):
    """Not the sum of every row: gradients and saved activations are never all alive at once."""
    _, plan = _measured_and_planned(data)
    persistent = sum(i.host for i in plan.items if i.persistent)
    assert {i.name for i in plan.items if i.persistent} == {"parameters (fp32 master)", "optimizer state"}
    assert plan.host_peak_rank == persistent + plan.update_peak.host
    assert plan.host_peak_rank < sum(i.host for i in plan.items)


def test_live_peak_counts_allocations_and_frees_exactly():
    from toolkit.plan.measure import LivePeak

    keep = torch.empty(0)
    with LivePeak() as live:
        a = torch.empty(1 << 20, dtype=torch.uint8)
        b = torch.empty(2 << 20, dtype=torch.uint8)
        del a, b
        keep = torch.empty(1 << 19, dtype=torch.uint8)
    assert live.peak == 3 << 20
    assert live.end == 1 << 19 and keep.numel() == 1 << 19


def test_offload_activations_moves_saved_tensors_to_the_host_but_not_checkpoint_inputs(data):
    """--offload-activations: saved activations wait in host memory (one block comes back for its
    backward); a checkpointed block's inputs are held by the checkpoint itself and stay on the GPU."""
    from toolkit.plan import PRESETS
    from toolkit.plan.model_stats import model_stats
    from toolkit.plan.setup import setup_from_config
    from toolkit.plan.update_peak import update_peak

    cfg = _cfg(data, "--bf16")
    stats = model_stats(cfg, torch.bfloat16)
    base = setup_from_config(cfg, gpu=True)
    gpu = PRESETS["h100"]
    b, L, act = base.batch_sequences, stats.num_layers, stats.activations
    plain, offloaded = (
        update_peak(stats, base, gpu),
        update_peak(stats, dataclasses.replace(base, offload_activations=True), gpu),
    )
    assert plain.where == "start of backward" and plain.host == 0
    assert offloaded.host == L * b * act.per_layer  # every block's saved activations
    assert b * act.per_layer <= offloaded.gpu < plain.gpu  # one block's come back for its backward
    ckpt = dataclasses.replace(base, checkpoint=True)
    assert update_peak(stats, dataclasses.replace(ckpt, offload_activations=True), gpu) == update_peak(stats, ckpt, gpu)


def test_fp16_state_is_counted_on_the_first_update_not_skipped(data):
    """--fp16's first updates may overflow and skip the step: the count waits for one that steps."""
    from toolkit.distributed.utils import init_distributed
    from toolkit.plan import PRESETS, make_plan
    from toolkit.plan.measure import measure_trainer
    from toolkit.train.train_loop import build_trainer, train_iterator

    cfg = _cfg(data, "--fp16", "--fp16-init-scale", "65536")  # overflows at first on purpose
    env = init_distributed(cfg.distributed, cpu=True)
    torch.manual_seed(0)
    trainer = build_trainer(cfg, env, [cfg.dataset.train_subset])
    counted = measure_trainer(
        trainer, iter(train_iterator(cfg, trainer, epoch=1).next_epoch_itr(shuffle=False)), tries=20
    )
    plan = make_plan(cfg, PRESETS["cpu"], world_size=1)
    assert counted["optimizer"] == next(i.host for i in plan.items if i.name == "optimizer state")
