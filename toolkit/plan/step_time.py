"""FLOPs and communication per step, and the step time they give.

Why this model: at scale a step is bounded by the matmuls (the model's FLOPs per token at a share
of the peak, ``Hardware.compute_efficiency``) unless a collective or the offloaded update is
slower. FSDP2's all-gathers and reduce-scatters overlap compute (prefetch), so they count only where
they exceed it; tensor-parallel collectives sit between a layer's matmuls and are exposed; the
offloaded update (CPU Adam) runs after backward unless ``--overlap-offload-step``; ``--offload-activations``
copies every block's saved activations to the host and back, and the step waits for them.

Ring collectives move ``(n - 1) / n`` of the buffer per rank (an all-reduce twice that); a group
within one node uses NVLink, one across nodes each GPU's NIC.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from toolkit.plan.hardware import Hardware
from toolkit.plan.memory import layer_share, shard_group, tp_numel
from toolkit.plan.model_stats import ModelStats
from toolkit.plan.setup import Setup

HBM_BYTES_PER_S = {"A100 40GB": 1.55e12, "A100 80GB": 2.0e12, "H100 80GB": 3.35e12, "H200 141GB": 4.8e12}
ADAM_BYTES_PER_PARAM = 28  # fused AdamW reads/writes param, grad, two moments (fp32): measured 14 ms for 1.3B on H100


@dataclass(frozen=True)
class StepTime:
    flops_per_rank: float
    compute_s: float
    comm: Tuple[Tuple[str, float, float], ...]  # (collective, bytes per rank, seconds)
    optimizer_s: float
    total_s: float
    tokens_per_step: int  # all ranks, one update
    bubble: float = 0.0  # the share of the step a pipeline's ranks wait (--pipeline-parallel-size)

    @property
    def tflops_per_gpu(self) -> float:
        return self.flops_per_rank / self.total_s / 1e12 if self.total_s > 0 else 0.0


def _link(hw: Hardware, ranks_spanned: int) -> float:
    gbps = hw.intra_node_gbps if ranks_spanned <= hw.gpus_per_node else hw.inter_node_gbps
    return gbps / 8 * 1e9 * hw.comm_efficiency


def collectives(stats: ModelStats, setup: Setup, hw: Hardware) -> List[Tuple[str, float, float, bool]]:
    """(name, bytes per rank per update, seconds, overlapped with compute)."""
    out: List[Tuple[str, float, float, bool]] = []
    P = tp_numel(stats, "all", setup)
    S, mb, cb = shard_group(setup, hw.gpus_per_node), setup.update_freq, setup.compute_bytes
    if setup.fsdp and S > 1:
        bw = _link(hw, S * setup.mp)
        gathers = mb * (2 if setup.reshard else 1)
        ag = gathers * cb * P * (S - 1) / S
        rs = 4 * P * (S - 1) / S  # reduce_dtype fp32, last micro-batch only
        out += [("all-gather", ag, ag / bw, True), ("reduce-scatter", rs, rs / bw, True)]
    replicas = setup.dp // S if setup.fsdp else setup.dp
    if replicas > 1:
        grads = 4 * P / S
        ar = 2 * grads * (replicas - 1) / replicas
        out.append(("all-reduce (data parallel)", ar, ar / _link(hw, setup.world), True))
    if setup.mp > 1:
        act = setup.batch_sequences * stats.tokens_per_sample * stats.embed_dim * cb
        per_layer = (4 + (2 if setup.checkpoint else 0)) * 2 * act * (setup.mp - 1) / setup.mp
        tp = mb * stats.num_layers * per_layer
        out.append(("tensor-parallel all-reduce", tp, tp / _link(hw, setup.mp), False))
    if setup.cp > 1:
        kv = context_parallel_bytes(stats, setup)
        out.append(("context-parallel K/V exchange", kv, kv / _link(hw, setup.cp * setup.mp), False))
    if setup.ep > 1 and stats.moe_layers:
        a2a = expert_all_to_all_bytes(stats, setup)
        out.append(("expert all-to-all", a2a, a2a / _link(hw, setup.ep * setup.mp), False))
    if setup.offload_activations and not setup.checkpoint and hw.has_gpu:
        moved = 2 * mb * offloaded_activations(stats, setup)  # out during forward, back in for backward
        out.append(("activation offload copies", moved, moved / _host_link(hw), False))
    if setup.cpu_offload and hw.has_gpu:
        S_params = 4 * P / S
        h2d = mb * (2 if setup.reshard else 1) * S_params + (2 if setup.bf16_host_grads else 4) * P / S
        out.append(("host <-> GPU copies", h2d, h2d / _host_link(hw), True))
    return out


def _host_link(hw: Hardware) -> float:
    return hw.host_link_gbps / 8 * 1e9 * hw.comm_efficiency


def offloaded_activations(stats: ModelStats, setup: Setup) -> float:
    """Bytes ``--offload-activations`` moves to the host per micro-batch: every block's saved activations (torch's
    ``save_on_cpu``, a copy the forward waits for; checkpointed blocks keep their inputs themselves)."""
    return setup.rank_sequences * stats.num_layers * stats.activations.per_layer * layer_share(setup)


def expert_all_to_all_bytes(stats: ModelStats, setup: Setup) -> float:
    """Bytes a rank sends per update in ``--expert-parallel-size P``'s exchanges (``moe._Exchange``): every MoE layer
    sends its [b T k, C] token rows to the experts' ranks and takes the outputs back (two exchanges), backward does
    both again for the gradients, and a checkpointed block's recomputed forward once more; (P-1)/P of the rows leave
    the rank (balanced routing). Not overlapped: the experts wait for their rows."""
    rows = setup.rank_sequences * stats.tokens_per_sample * stats.moe_top_k
    per_layer = 2 * rows * stats.embed_dim * setup.compute_bytes * (setup.ep - 1) / setup.ep
    return setup.update_freq * stats.moe_layers * per_layer * (3 if setup.checkpoint else 2)


def context_parallel_bytes(stats: ModelStats, setup: Setup) -> float:
    """Bytes a CP rank receives per update for the keys/values (``toolkit.distributed.context_parallel``): each
    layer all-gathers its k and v of the whole sequence (the others' (C-1)/C of it), again when a checkpointed
    block is recomputed, and backward all-reduces their gradients (a ring all-reduce: twice the gather's bytes).
    Not overlapped: the attention waits for the gather."""
    kv_width = stats.kv_width / setup.mp  # keys and values are split by heads under tensor parallelism
    whole = setup.batch_sequences * stats.tokens_per_sample * kv_width * setup.compute_bytes
    gather = whole * (setup.cp - 1) / setup.cp
    return setup.update_freq * gather * (3 + (1 if setup.checkpoint else 0))


def step_time(stats: ModelStats, setup: Setup, hw: Hardware) -> StepTime:
    if setup.pp > 1:
        return pipelined_step_time(stats, setup, hw)
    tokens_rank = setup.rank_sequences * stats.tokens_per_sample * setup.update_freq
    flops = stats.flops_per_token * tokens_rank / setup.mp
    executed = flops * (8 / 6 if setup.checkpoint else 1.0)  # the recomputed forward
    peak = (hw.gpu_tflops if setup.compute_bytes == 2 else hw.fp32_tflops) * 1e12
    compute = executed / (peak * hw.compute_efficiency)
    comms = collectives(stats, setup, hw)
    overlapped = sum(s for _, _, s, o in comms if o)
    exposed = sum(s for _, _, s, o in comms if not o)
    P_local = tp_numel(stats, "all", setup) / shard_group(setup, hw.gpus_per_node)
    if setup.cpu_offload or setup.optimizer == "cpu_adam" or not hw.has_gpu:
        ranks_on_node = min(hw.gpus_per_node, setup.world)
        optimizer = P_local * ranks_on_node / (hw.cpu_adam_gparams * 1e9)
    else:
        optimizer = ADAM_BYTES_PER_PARAM * P_local / HBM_BYTES_PER_S.get(hw.name, 2.0e12)
    total = max(compute, overlapped) + exposed + optimizer
    return StepTime(
        flops, compute, tuple((n, b, s) for n, b, s, _ in comms), optimizer, total, int(round(tokens_rank * setup.dp))
    )


def pipelined_step_time(stats: ModelStats, setup: Setup, hw: Hardware) -> StepTime:
    """``--pipeline-parallel-size``: each pp rank's step (its stages' FLOPs over the whole batch, FSDP2's
    collectives of its stage with the layers kept gathered, the sends and receives at its boundaries), the compute
    stretched by the schedule's bubble (:func:`toolkit.plan.pipeline.bubble_fraction`); the slowest rank's."""
    import dataclasses

    from toolkit.plan import pipeline

    bubble = pipeline.bubble_fraction(setup.pp_schedule, setup.pp, pipeline.microbatches(setup))
    flat = dataclasses.replace(setup, pp=1, reshard=False)
    flat = dataclasses.replace(flat, world=setup.world // setup.pp)  # a stage's ranks
    slowest = None
    for view in pipeline.rank_views(stats, setup):
        t = step_time(view.stats, flat, hw)
        comms = collectives(view.stats, flat, hw) + [pipeline.pipeline_comm(stats, setup, _link(hw, setup.world))]
        overlapped = sum(s for _, _, s, o in comms if o)
        exposed = sum(s for _, _, s, o in comms if not o)
        total = max(t.compute_s / (1 - bubble), overlapped) + exposed + t.optimizer_s
        if slowest is None or total > slowest.total_s:
            comm = tuple((n, b, s) for n, b, s, _ in comms)
            slowest = dataclasses.replace(t, comm=comm, total_s=total, bubble=bubble)
    flops = stats.flops_per_token * setup.rank_sequences * stats.tokens_per_sample * setup.update_freq / setup.mp
    return dataclasses.replace(slowest, flops_per_rank=flops / setup.pp)
