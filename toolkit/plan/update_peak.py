"""The peak of one update: what is alive at the same moment, not the sum of the plan's rows.

Why two moments: the rows of a plan (gradients, gathered parameters, saved activations, backward
transients) never all live at once. Backward frees the saved activations from the top block down
while the gradients grow from nothing, so the live bytes of an update are highest at one of its two
ends (between them both change by about a block's worth per block):

* **start of backward** (the top block): every block's saved activations (with
  ``--checkpoint-activations`` only the block inputs: torch's non-reentrant checkpoint keeps a block's
  arguments and nothing else), plus the larger of the head's share (final norm, logits, log-softmax
  and the logits' gradient) and the top block's own backward (with checkpointing: its recomputed
  activations, all alive at once, and the gradient flowing through it). shard_grad_op
  (``reshard_after_forward=False``) still holds every block's gathered parameters here.
* **backward of the first block**: all gradients, the first block's saved activations (recomputed
  in full under checkpointing) and the gradient flow; FSDP2 holds the root and this block gathered
  (the others were resharded after their backward) and this block's unsharded gradients.

Both moments count what ``toolkit.plan.measure.LivePeak`` measures: live tensor bytes above the
parameters and optimizer state, which exist before and after the update (the planner's persistent
rows). ``benchmarks/plan_check.py`` compares the two on CPU runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from toolkit.plan.hardware import Hardware
from toolkit.plan.memory import (
    block_shard,
    context_parallel_held,
    expert_exchange,
    grad_bytes_by_part,
    layer_share,
    tp_numel,
)
from toolkit.plan.model_stats import ModelStats
from toolkit.plan.setup import Setup

GPU, HOST, STATES, SAVED = "gpu", "host", "states", "saved"  # where a term lives (see _place)


@dataclass(frozen=True)
class Peak:
    gpu: int
    host: int
    where: str  # the moment that decides the GPU peak (the host peak when there is no GPU)


@dataclass(frozen=True)
class Moments:
    """Bytes per rank of the terms alive at the two moments, each with the place it lives in."""

    top: List[Tuple[int, str]]
    bottom: List[Tuple[int, str]]


def _gathered(stats: ModelStats, setup: Setup, gpus_per_node: int = 8, has_gpu: bool = True) -> Tuple[int, int, int]:
    """(gathered parameter bytes at the start of backward, at the first block, one block's unsharded grads).

    Under ``--cpu-offload`` on a GPU, FSDP2 copies a block's fp32 shard to the GPU before casting it for the
    all-gather (``FSDPParam.all_gather_inputs``: the prefetched block's, 4 bytes a value), and its reduce-scatter
    output (fp32) waits on the GPU for the copy to the host."""
    if not setup.fsdp:
        return 0, 0, 0
    cb = setup.compute_bytes
    block, root, total = (tp_numel(stats, part, setup) for part in ("block", "root", "all"))
    top = cb * (root + 2 * block) if setup.reshard else cb * total  # full_shard: last block + the prefetched one
    accumulated = 4 * total if setup.update_freq > 1 else 0  # FSDP2 keeps unsharded fp32 grads between micro-batches
    staged = 4 * block_shard(stats, setup, gpus_per_node) if setup.cpu_offload and has_gpu else 0
    return top + staged, cb * (root + block) + staged, (cb + 4) * block + accumulated + staged


def _autocast_copies(stats: ModelStats, setup: Setup) -> Tuple[int, int]:
    """Weights autocast casts (DDP/one process under --fp16/--bf16) and autograd keeps: (top, first block)."""
    if setup.fsdp or setup.compute_bytes != 2 or setup.memory_efficient_fp16:
        return 0, 0
    block, root = 2 * tp_numel(stats, "matmul block", setup), 2 * tp_numel(stats, "matmul root", setup)
    return root + (0 if setup.checkpoint else stats.num_layers * block), block


def moments(stats: ModelStats, setup: Setup, gpus_per_node: int = 8, has_gpu: bool = True) -> Moments:
    """The terms of both moments (see the module docstring)."""
    act, b, M = stats.activations, setup.rank_sequences, setup.mp
    share = layer_share(setup)
    kept = int(b * (act.block_input / M if setup.checkpoint else act.per_layer * share))  # per block, to backward
    recompute = int(b * act.per_layer * share) if setup.checkpoint else 0
    flow = int(2 * b * stats.tokens_per_sample * stats.embed_dim * 4 / (M if setup.sequence_parallel else 1))
    head = int(b * act.rest / M + b * stats.tokens_per_sample * stats.vocab_size / M * (4 + setup.compute_bytes))
    grads, grads_top = grad_bytes_by_part(stats, setup, gpus_per_node)
    gathered_top, gathered_bottom, grad_buffers = _gathered(stats, setup, gpus_per_node, has_gpu)
    flow += expert_exchange(stats, setup)  # the top block's and the first block's backward both exchange
    casts_top, casts_bottom = _autocast_copies(stats, setup)
    inputs_place = GPU if setup.checkpoint else SAVED  # a checkpoint's arguments bypass --offload-activations
    top = [
        (grads if setup.update_freq > 1 else grads_top, STATES),
        (gathered_top + grad_buffers + casts_top, GPU),
        (stats.num_layers * kept, inputs_place),
        (max(head, recompute + flow), GPU),
    ]
    bottom = [
        (grads, STATES),
        (gathered_bottom + grad_buffers + casts_bottom, GPU),
        (kept, inputs_place),
        (recompute + flow + (kept if setup.offload_activations and not setup.checkpoint else 0), GPU),
    ]
    if setup.bucketed_all_reduce:
        bottom.append((2 * (64 << 20), GPU))  # the flat bucket and its reduced copy, after backward
    if setup.cp > 1:  # every layer's gathered keys/values (the recomputed top one's under checkpointing); the mask
        gathered, mask = context_parallel_held(stats, setup, has_gpu)
        top += [(gathered * (1 if setup.checkpoint else stats.num_layers), inputs_place), (mask, GPU)]
        bottom += [(gathered, inputs_place), (mask, GPU)]
    return Moments(top, bottom)


def _place(setup: Setup, hw: Hardware, where: str) -> str:
    if not hw.has_gpu:
        return HOST
    if where == STATES:
        return HOST if setup.cpu_offload or setup.optimizer == "cpu_adam" else GPU
    if where == SAVED:
        return HOST if setup.offload_activations else GPU
    return where


def update_peak(stats: ModelStats, setup: Setup, hw: Hardware) -> Peak:
    """The highest live bytes of an update above the persistent state, on the GPU and in host memory."""
    m = moments(stats, setup, hw.gpus_per_node, hw.has_gpu)
    totals = {}
    for name, terms in (("start of backward", m.top), ("backward of the first block", m.bottom)):
        gpu = sum(n for n, w in terms if _place(setup, hw, w) == GPU)
        totals[name] = (gpu, sum(n for n, w in terms) - gpu)
    key = 0 if hw.has_gpu else 1
    where = max(totals, key=lambda k: totals[k][key])
    return Peak(max(t[0] for t in totals.values()), max(t[1] for t in totals.values()), where)
