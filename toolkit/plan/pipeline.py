"""Pipeline stages in a plan (``--pipeline-parallel-size P``): each pp rank's memory, and the bubble in the step time.

What a pp rank holds (``toolkit.distributed.pipeline`` builds it so):

* the parameters, gradients and optimizer state of its stages' layers (the split training makes: the layers'
  parameter counts, the embeddings counted on the first stage, the final norm and the head on the last), sharded by
  FSDP2 over the stage's data ranks; FSDP2 keeps a stage's layers gathered for the whole step (the micro-batches in
  flight need them again), so the gathered parameters are the stage's, not two blocks';
* the saved activations of the micro-batches its schedule keeps in flight, at the moment they are most: ``gpipe``
  all ``m``, ``1f1b`` ``min(m, P - r)`` on rank r (P on the first), the multi-stage schedules (``interleaved_1f1b``,
  ``zero_bubble``, ``dualpipev``) as the action order torch's schedule class generates says (a forward adds a
  micro-batch to its stage, a full backward or a weight backward removes it: the zero-bubble input backward keeps what
  the weight backward still reads); the last stage's logits and loss for each micro-batch it holds;
* torch's receive buffers, one per micro-batch, for the activations coming in (not the first stage) and the
  gradients coming back (not the last), allocated at the first step and kept.

The bubble: the share of a step each rank waits, with equal forward, input-backward and weight-backward times per
layer and micro-batch: ``(P-1)/(m+P-1)`` for ``gpipe`` and ``1f1b``; the interleaved schedule cuts the fill and the
drain into V = 2 virtual stages, ``(P-1)/(Vm+P-1)``; the zero-bubble schedules fill two thirds of that with weight
backwards, ``(P-1)/(3Vm+P-1)`` (``zero_bubble``) and ``(P-1)/(3m+P-1)`` (``dualpipev``: DualPipe's
``(P-1)(F&B + B - 3W)`` of its half-size chunks). ``benchmarks/pipeline_schedules.py`` measures both on CPU ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import List, Sequence, Tuple

import numpy as np

from toolkit.core.errors import UserError
from toolkit.distributed.pipeline import (
    SCHEDULES,
    default_microbatches,
    layer_costs,
    layer_counts,
    rank_stage_indices,
    virtual_stages,
)
from toolkit.plan.hardware import Hardware
from toolkit.plan.memory import GPU_RUNTIME, HOST_RUNTIME, Item, buffer_items, layer_share, model_state_items
from toolkit.plan.model_stats import Activations, ModelStats, ParamInfo
from toolkit.plan.setup import Setup

PIPELINE_SCHEDULES = tuple(SCHEDULES)


def microbatches(setup: Setup) -> int:
    return setup.pp_microbatches or default_microbatches(setup.pp, setup.pp_schedule)


def bubble_fraction(schedule: str, pp: int, m: int) -> float:
    """The share of a step a rank waits (module docstring)."""
    fill = pp - 1
    per_rank = {"interleaved_1f1b": virtual_stages(schedule), "zero_bubble": 3 * virtual_stages(schedule)}
    per_rank["dualpipev"] = 3
    units = per_rank.get(schedule, 1) * m
    return fill / (units + fill)


@functools.cache
def in_flight(schedule: str, pp: int, m: int) -> Tuple[Tuple[Tuple[int, ...], ...], ...]:
    """For each rank of the pp axis, after each action of its schedule: the micro-batches each of its stages
    (``rank_stage_indices``' order) holds saved activations of, then those of each whose input backward ran and
    weight backward did not (they hold the gradients of the stage's matmul outputs too); ValueError where torch's
    schedule refuses ``m``. Only the states no other state of the rank exceeds in every count are kept: a rank's
    peak memory, a sum of the counts with non-negative weights, is always one of them, and the layout search
    prices each rank's states for every batch it tries."""
    if virtual_stages(schedule) == 1:
        return tuple(((m if schedule == "gpipe" else min(m, pp - r), 0),) for r in range(pp))
    from torch.distributed import pipelining
    from torch.distributed.pipelining import schedules

    class OrderOnly(getattr(pipelining, SCHEDULES[schedule][0])):
        """The schedule's compute order without the send, receive and unshard actions torch adds for running it
        (most of the constructor's time at hundreds of micro-batches; the plan counts only the compute)."""

        def _prepare_schedule_with_comms(self, *args: object, **kwargs: object) -> None:
            pass

    V = virtual_stages(schedule)
    stand_ins = [
        SimpleNamespace(num_stages=pp * V, group_size=pp, group_rank=0, stage_index=s, submod=None)
        for s in rank_stage_indices(0, pp, schedule)
    ]
    order = OrderOnly(stand_ins, n_microbatches=m, loss_fn=lambda *a: None, scale_grads=False).pipeline_order
    change = {  # (saved, awaiting the weight backward) per action
        schedules.FORWARD: (1, 0),
        schedules.FULL_BACKWARD: (-1, 0),
        schedules.BACKWARD_INPUT: (0, 1),
        schedules.BACKWARD_WEIGHT: (-1, -1),
    }
    out = []
    for r in range(pp):
        local = rank_stage_indices(r, pp, schedule)
        held, states = [0] * (2 * V), []
        for action in order[r]:
            for a in (action.sub_actions or (action,)) if action is not None else ():
                saved, waiting = change.get(a.computation_type, (0, 0))
                held[local.index(a.stage_index)] += saved
                held[V + local.index(a.stage_index)] += waiting
                states.append(tuple(held))
        out.append(_not_exceeded(states))
    return tuple(out)


def _not_exceeded(states: Sequence[Tuple[int, ...]]) -> Tuple[Tuple[int, ...], ...]:
    """The distinct states that no other state is at least as large as in every count (in their first order)."""
    unique = list(dict.fromkeys(states))
    counts = np.array(unique, dtype=np.int64).reshape(len(unique), -1)
    at_least = (counts[None, :, :] >= counts[:, None, :]).all(axis=2)  # [a, b]: b is at least a everywhere
    exceeded = (at_least & ~np.eye(len(unique), dtype=bool)).any(axis=1)
    return tuple(a for a, out in zip(unique, exceeded) if not out)


@dataclass(frozen=True)
class StageRank:
    """One pp rank's part of the plan."""

    rank: int
    layers: Tuple[Tuple[int, int], ...]  # (first layer, layers) of each of its stages
    first: bool  # holds the embeddings
    last: bool  # holds the final norm, the head and the loss
    in_flight: int  # micro-batches whose activations it holds at its peak (summed over its stages)
    items: Tuple[Item, ...]

    @property
    def gpu(self) -> int:
        return sum(i.gpu for i in self.items)

    @property
    def host(self) -> int:
        return sum(i.host for i in self.items)

    def describe(self) -> str:
        spans = ", ".join(f"{a}-{a + n - 1}" if n > 1 else str(a) for a, n in self.layers)
        ends = (" + embeddings" if self.first else "") + (" + head and loss" if self.last else "")
        return f"layers {spans}{ends}"


def stage_split(stats: ModelStats, setup: Setup) -> List[int]:
    """Layers per stage as training splits them (``--pipeline-balance`` or the cost-weighted default), kept per
    model (the layout search asks for the same split for many batches and settings)."""
    stages = setup.pp * virtual_stages(setup.pp_schedule)
    key = ("stage split", stages, setup.pp_balance)
    if key not in stats.memo:
        if "layer costs" not in stats.memo:
            stats.memo["layer costs"] = layer_costs([(p.name, p.numel) for p in stats.params], stats.num_layers)
        stats.memo[key] = layer_counts(stats.num_layers, stages, setup.pp_balance, stats.memo["layer costs"])
    return list(stats.memo[key])


def rank_stats(stats: ModelStats, spans: Sequence[Tuple[int, int]], first: bool, last: bool) -> ModelStats:
    """``stats`` cut to what one pp rank holds: its layers (renumbered from 0, so the planner's block sums hold),
    the embeddings on the first stage's rank, the rest of the root on the last's; the FLOPs in proportion to the
    parameters kept."""
    keep = {i: k for k, i in enumerate(i for a, n in spans for i in range(a, a + n))}

    def kept(p: ParamInfo) -> bool:
        if p.layer is not None:
            return p.layer in keep
        return first if "embed" in p.name else last

    params = tuple(
        dataclasses.replace(p, layer=None if p.layer is None else keep[p.layer]) for p in stats.params if kept(p)
    )
    share = sum(p.numel for p in params) / max(1, stats.num_params)
    fraction = len(keep) / stats.num_layers
    act = stats.activations
    return dataclasses.replace(
        stats,
        params=params,
        num_layers=len(keep),
        flops_per_token=stats.flops_per_token * share,
        activations=Activations(act.per_layer, act.rest if last else 0, act.block_input),
        kv_width=int(stats.kv_width * fraction),
        moe_layers=round(stats.moe_layers * fraction),
        attention_layers=round(stats.attention_layers * fraction),
    )


@dataclass(frozen=True)
class RankView:
    """What one pp rank holds: its stages' indices, their (first layer, layers), and the model cut to them."""

    stages: Tuple[int, ...]
    spans: Tuple[Tuple[int, int], ...]
    first: bool
    last: bool
    stats: ModelStats


def rank_views(stats: ModelStats, setup: Setup) -> Tuple[RankView, ...]:
    """Every pp rank's view, kept per model (the layout search prices many batches and settings of one split)."""
    key = ("rank views", setup.pp, setup.pp_schedule, setup.pp_balance)
    if key not in stats.memo:
        stats.memo[key] = _rank_views(stats, setup)
    return stats.memo[key]


def _rank_views(stats: ModelStats, setup: Setup) -> Tuple[RankView, ...]:
    counts = stage_split(stats, setup)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    out = []
    for r in range(setup.pp):
        stages = tuple(rank_stage_indices(r, setup.pp, setup.pp_schedule))
        spans = tuple((starts[s], counts[s]) for s in stages)
        first, last = 0 in stages, len(counts) - 1 in stages
        out.append(RankView(stages, spans, first, last, rank_stats(stats, spans, first, last)))
    return tuple(out)


def stage_ranks(stats: ModelStats, setup: Setup, hw: Hardware) -> Tuple[StageRank, ...]:
    """Every pp rank's items (module docstring)."""
    views = rank_views(stats, setup)
    layers = {s: n for view in views for s, (_, n) in zip(view.stages, view.spans)}
    counts = [layers[s] for s in range(len(layers))]
    flights = in_flight(setup.pp_schedule, setup.pp, microbatches(setup))
    out = []
    for r, view in enumerate(views):
        items, held = rank_items(view.stats, setup, hw, view.stages, counts, flights[r])
        out.append(StageRank(r, view.spans, view.first, view.last, held, tuple(items)))
    return tuple(out)


def microbatch_sequences(setup: Setup) -> float:
    """Sequences' worth of tokens per micro-batch and rank (the batch's rows padded to a multiple of m)."""
    return math.ceil(setup.batch_sequences / microbatches(setup)) / setup.cp


def rank_items(
    stats: ModelStats,
    setup: Setup,
    hw: Hardware,
    stages: Sequence[int],
    counts: Sequence[int],
    flights: Sequence[Tuple[int, ...]],
) -> Tuple[List[Item], int]:
    """One pp rank's rows (``stats``: what it holds; ``stages``: its stages' indices; ``counts``: every stage's
    layers) and the micro-batches in flight at its peak: its model state, FSDP2's gathered stage and gradient
    buffers, the activations of the micro-batches in flight at their most, one micro-batch's backward transient,
    the receive buffers."""
    act, b, M, cb = stats.activations, microbatch_sequences(setup), setup.mp, setup.compute_bytes
    share, T, C = layer_share(setup), stats.tokens_per_sample, stats.embed_dim
    top = len(counts) - 1
    per_layer = act.block_input / M if setup.checkpoint else act.per_layer * share
    weights = [b * (counts[s] * per_layer + (act.rest / M if s == top else 0)) for s in stages]
    outputs = matmul_outputs(stats)  # the gradients a weight backward reads, per token: a block's, the head's
    weights += [b * T * cb * (counts[s] * outputs[0] + (outputs[1] if s == top else 0)) / M for s in stages]
    peak = max(flights, key=lambda state: sum(n * w for n, w in zip(state, weights)))
    saved = sum(n * w for n, w in zip(peak, weights))
    recompute = b * act.per_layer * share if setup.checkpoint else 0
    flow = 2 * b * T * C * 4 / (M if setup.sequence_parallel else 1)
    logits_grad = b * T * stats.vocab_size / M * (4 + cb) if top in stages else 0
    m = microbatches(setup)
    boundary = m * b * T * C * cb / (M if setup.sequence_parallel else 1)
    receives = boundary * sum((s != 0) + (s != top) for s in stages)
    where = (lambda n: (int(n), 0)) if hw.has_gpu else (lambda n: (0, int(n)))
    saved_where = where if not setup.offload_activations else (lambda n: (0, int(n)))
    items = model_state_items(stats, setup, hw) + [
        dataclasses.replace(i, note="this rank's stages, kept gathered") if i.name == "gathered parameters" else i
        for i in buffer_items(stats, dataclasses.replace(setup, reshard=False), hw)
    ]
    note = f"{sum(peak[: len(stages)])} stage micro-batch(es) of {b:g} x {T} tokens in flight" + (
        ", checkpointed" if setup.checkpoint else ""
    )
    items += [
        Item("activations (saved)", *saved_where(saved), note),
        Item("backward transient", *where(max(recompute + flow, logits_grad)), "one micro-batch"),
        Item("receive buffers", *where(receives), f"one per micro-batch ({m}) and direction", True),
    ]
    if hw.has_gpu:
        items.append(Item("runtime", GPU_RUNTIME, HOST_RUNTIME, "CUDA context, libraries", True))
    return items, sum(peak[: len(stages)])


def matmul_outputs(stats: ModelStats) -> Tuple[int, int]:
    """Output features per token of one block's matmuls and of the root's (the head: the embeddings are no matmul
    output), i.e. the gradients the zero-bubble schedules keep from a stage's input backward to its weight backward."""
    block = sum(p.shape[0] * n for p, n in stats.param_groups if p.matmul and p.layer == 0)
    head = sum(p.shape[0] for p in stats.params if p.matmul and p.layer is None and "embed" not in p.name)
    return block, head


def pipeline_comm(stats: ModelStats, setup: Setup, bandwidth: float) -> Tuple[str, float, float, bool]:
    """The activations sent forward and their gradients sent back at a rank's stage boundaries per update
    (overlapped: torch's schedules post the sends and receives beside the compute); ``bandwidth`` in bytes/s."""
    T, C, cb = stats.tokens_per_sample, stats.embed_dim, setup.compute_bytes
    moved = 2 * setup.update_freq * microbatches(setup) * microbatch_sequences(setup) * T * C * cb / setup.mp
    moved *= virtual_stages(setup.pp_schedule)
    return ("pipeline send/receive", moved, moved / bandwidth, True)


def check_pipeline(stats: ModelStats, setup: Setup) -> None:
    """Refuse, in one line naming the flag, the pipelines training refuses: more stages than layers, a
    ``--pipeline-balance`` that does not add up, micro-batches torch's schedule does not take."""
    if setup.pp == 1:
        return
    stage_split(stats, setup)
    try:
        in_flight(setup.pp_schedule, setup.pp, microbatches(setup))
    except ValueError as e:
        raise UserError(
            f"--pipeline-microbatches {microbatches(setup)}: {setup.pp_schedule} refuses it ({e})"
        ) from None
