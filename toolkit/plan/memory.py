"""Bytes per rank, on the GPU and in host memory, item by item.

The counts follow what the trainer allocates (the tests compare them with its tensors):

* FSDP2 (``--ddp-backend fully_sharded``, and every ``--model-parallel-size`` > 1 run) keeps each
  parameter's fp32 shard: dim 0 padded to a multiple of the shard group, ``ceil(rows / S)`` rows per
  rank; the sharded gradient likewise (bf16 under ``--bf16-host-grads``). While a block runs its
  parameters are gathered in the compute dtype; ``full_shard``/``hybrid_shard`` free them after the
  block's forward (two blocks live with prefetch, plus the root's embeddings and output layer, never
  resharded), the others keep the whole model gathered until backward ends.
* DDP and ``no_c10d`` keep whole fp32 parameters and gradients (fp16 ones under
  ``--memory-efficient-fp16``); under ``--fp16``/``--bf16`` autocast keeps a cast copy of every
  matmul weight until backward. ``no_c10d`` under ``--model-parallel-size M`` has no FSDP2: each rank keeps
  its TP shards of everything (1/M of the split tensors, the rest whole), unsharded over the data-parallel
  ranks, and all-reduces their gradients in buckets.
* MoE expert stacks [E, ...]: E/P experts a rank under ``--expert-parallel-size P``, sharded by FSDP2 over the
  (dp_shard x cp) / P ranks holding the same ones (``ParallelDims.mesh(*EXPERT_PEERS)``); each MoE layer's backward
  under EP also holds the exchanged gradient rows (:func:`expert_exchange`). ``--cpu-offload`` on a GPU stages a
  block's fp32 shard (copied in before the bf16 cast) and its fp32 reduce-scatter output (copied out).
* Optimizer state: what the optimizer declares where it registers (``OptimizerState`` in
  ``toolkit.core.registry``): torch AdamW 8 bytes per parameter plus a 4-byte step per tensor (also
  ``--optimizer muon``'s AdamW side; its matrices keep one momentum, 4 bytes a value or 2 under
  ``--muon-momentum-dtype bf16``); cpu_adam per ``--adam-state-precision``
  (``toolkit.optim.quantized_states``'s layouts: 8-bit moments with one fp32 scale per 2048-value block of
  a row, fp32 for tensors under 4096 values or 1-D); sgd's momentum buffer (none without momentum). An
  optimizer that declares nothing (a ``--user-dir`` plugin) is refused, not priced as Adam.
* Activations: the meta-device trace of :mod:`toolkit.plan.model_stats` times the sequences per
  micro-batch; a checkpointed layer keeps its input, and backward recomputes one layer at a time.
  Tensor parallelism with sequence parallelism splits them over M. Context parallelism (``--context-parallel-size
  C``) divides them by C and adds what a rank holds of the whole sequence (:func:`context_parallel_held`).

Each row is that item's largest size. The rows marked ``persistent`` (parameters, optimizer state,
runtime) live through the whole run; the others come and go within an update, and their peak is
:func:`toolkit.plan.update_peak.update_peak`'s (what is alive at once), not their sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

from toolkit.core.errors import UserError
from toolkit.core.registry import OPTIMIZER_REGISTRY, OptimizerState, ParameterPiece
from toolkit.plan.hardware import GIB, Hardware
from toolkit.plan.model_stats import ModelStats, ParamInfo
from toolkit.plan.setup import Setup

GPU_RUNTIME = int(1.0 * GIB)  # CUDA context, NCCL and cuBLAS workspaces (outside torch's allocator)
HOST_RUNTIME = int(5.0 * GIB)  # per GPU process: torch + CUDA libraries, data loading (6.7B offload: 102.5 GiB
# measured against 96.9 GiB of model states, benchmarks/README.md)


@dataclass(frozen=True)
class Item:
    name: str
    gpu: int
    host: int
    note: str = ""
    persistent: bool = False  # alive between updates (counted whole in the peak); else within an update


def shard_group(setup: Setup, gpus_per_node: int) -> int:
    """S: the ranks one parameter is sharded over (1 when replicated), from the layout training builds."""
    return setup.layout(gpus_per_node).fsdp_shard


def local_shape(p: ParamInfo, mp: int, shards: int, ep: int = 1) -> Tuple[int, ...]:
    """The shape of this rank's piece: dim 0 split over TP (when split), then over the FSDP shard group. An expert
    stack keeps E/ep experts (``--expert-parallel-size``), sharded over the ranks holding the same ones
    (``ParallelDims.mesh(*EXPERT_PEERS)``: the shard group / ep)."""
    shape = list(p.shape) or [1]
    if p.tp_split and mp > 1:
        shape[0] = math.ceil(shape[0] / mp)
    if p.expert and ep > 1:
        shape[0], shards = math.ceil(shape[0] / ep), max(1, shards // ep)
    if shards > 1:
        shape[0] = math.ceil(shape[0] / shards)
    return tuple(shape)


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


PARTS: Dict[str, Callable[[ParamInfo, int], bool]] = {  # (parameter, top block's index) -> in the part
    "all": lambda p, top: True,
    "block": lambda p, top: p.layer == 0,  # one block (every block has the same parameters)
    "root": lambda p, top: p.layer is None,  # embeddings, final norm, output layer
    "first": lambda p, top: p.layer is None or p.layer == top,  # what backward makes gradients for first
    "matmul": lambda p, top: p.matmul,
    "matmul block": lambda p, top: p.matmul and p.layer == 0,
    "matmul root": lambda p, top: p.matmul and p.layer is None,
}


def local_numel(stats: ModelStats, part: str, mp: int, shards: int = 1, ep: int = 1) -> int:
    """Values of the parameters of ``part`` (:data:`PARTS`) one rank keeps under TP ``mp``, FSDP2 shard group
    ``shards`` (1: whole, as gathered to compute) and EP ``ep``. Kept per model: the layout search asks the same
    sums for many layouts."""
    key = ("numel", part, mp, shards, ep)
    if key not in stats.memo:
        top, keep = stats.num_layers - 1, PARTS[part]
        stats.memo[key] = sum(n * _numel(local_shape(p, mp, shards, ep)) for p, n in stats.param_groups if keep(p, top))
    return stats.memo[key]


def optimizer_state(name: str) -> OptimizerState:
    """What ``--optimizer name`` declares it keeps per parameter; an optimizer that declares nothing cannot be priced
    and is refused in one line (its memory is the plan's largest item after the activations: a guess would
    decide whether the run fits)."""
    state = OPTIMIZER_REGISTRY.state(name)
    if state is None:
        raise UserError(
            f"--optimizer {name}: declares no optimizer state, so its memory cannot be planned; register it with "
            f"@register_optimizer({name!r}, dataclass=..., state=OptimizerState(bytes_of, note)) "
            f"(toolkit.core.registry: bytes_of(options, piece) gives the bytes it keeps for one parameter piece)"
        )
    return state


def optimizer_state_bytes(setup: Setup, p: ParamInfo, local: Tuple[int, ...]) -> int:
    """Optimizer state of one parameter's local piece, as its optimizer declares it (step counters included)."""
    piece = ParameterPiece(tuple(p.shape), tuple(local), p.role)
    return optimizer_state(setup.optimizer).bytes_of(setup.optimizer_options, piece)


def _grad_width(setup: Setup) -> int:
    return 2 if (setup.bf16_host_grads or (setup.memory_efficient_fp16 and not setup.fsdp)) else 4


def grad_bytes_by_part(stats: ModelStats, setup: Setup, gpus_per_node: int = 8) -> Tuple[int, int]:
    """(all gradient bytes of this rank, those of the root and the top block: the first ones backward makes)."""
    S, width = shard_group(setup, gpus_per_node), _grad_width(setup)
    return (
        width * local_numel(stats, "all", setup.mp, S, setup.ep),
        width * local_numel(stats, "first", setup.mp, S, setup.ep),
    )


def optimizer_bytes(stats: ModelStats, setup: Setup, shards: int) -> int:
    """The optimizer state of every parameter piece this rank keeps (kept per model and settings)."""
    key = ("optimizer", setup.optimizer, repr(setup.optimizer_options), setup.mp, shards, setup.ep)
    if key not in stats.memo:
        stats.memo[key] = sum(
            n * optimizer_state_bytes(setup, p, local_shape(p, setup.mp, shards, setup.ep))
            for p, n in stats.param_groups
        )
    return stats.memo[key]


def model_state_items(stats: ModelStats, setup: Setup, hw: Hardware) -> List[Item]:
    """Parameters, gradients and optimizer state per rank (exact counts: the tests check them)."""
    S = shard_group(setup, hw.gpus_per_node)
    n = local_numel(stats, "all", setup.mp, S, setup.ep)
    param_bytes = (2 if setup.memory_efficient_fp16 and not setup.fsdp else 4) * n
    grad_bytes = _grad_width(setup) * n
    optim = optimizer_bytes(stats, setup, S)
    host = setup.cpu_offload or setup.optimizer == "cpu_adam" or not hw.has_gpu
    where = (lambda b: Item("", 0, b)) if host else (lambda b: Item("", b, 0))
    note = f"1/{S} shard" if S > 1 else "whole"
    return [
        _named(where(param_bytes), "parameters (fp32 master)" if param_bytes == 4 * n else "parameters", note, True),
        _named(where(grad_bytes), "gradients", note),
        _named(where(optim), "optimizer state", optimizer_note(setup), True),
    ]


def optimizer_note(setup: Setup) -> str:
    return optimizer_state(setup.optimizer).note(setup.optimizer_options) or setup.optimizer


def _named(item: Item, name: str, note: str, persistent: bool = False) -> Item:
    return Item(name, item.gpu, item.host, note, persistent)


def tp_numel(stats: ModelStats, part: str, setup: Setup) -> int:
    """Values of ``part``'s parameters a rank computes with (gathered): its TP shards and its E/ep experts."""
    return local_numel(stats, part, setup.mp, 1, setup.ep)


def block_shard(stats: ModelStats, setup: Setup, gpus_per_node: int = 8) -> int:
    """Values of one block this rank keeps (its FSDP2 shard)."""
    return local_numel(stats, "block", setup.mp, shard_group(setup, gpus_per_node), setup.ep)


def expert_exchange(stats: ModelStats, setup: Setup) -> int:
    """Bytes of one MoE layer's backward exchange under ``--expert-parallel-size`` (``moe._Exchange``): the gradient
    rows received from the other ranks and their copy sorted back into this rank's order, [b T k, C] each in the
    compute dtype (balanced routing; a rank that owns the busiest experts receives more)."""
    if setup.ep == 1 or not stats.moe_layers:
        return 0
    rows = setup.rank_sequences * stats.tokens_per_sample * stats.moe_top_k
    return int(2 * rows * stats.embed_dim * setup.compute_bytes / (setup.mp if setup.sequence_parallel else 1))


def buffer_items(stats: ModelStats, setup: Setup, hw: Hardware) -> List[Item]:
    """Gathered parameters and gradient buffers (communication), transient but at the peak."""
    cb = setup.compute_bytes
    block, top, total = (
        tp_numel(stats, "block", setup),
        tp_numel(stats, "root", setup),
        tp_numel(stats, "all", setup),
    )
    items: List[Item] = []
    if setup.fsdp:
        held = top + 2 * block if setup.reshard else total
        items.append(
            Item(
                "gathered parameters",
                cb * held,
                0,
                "root + 2 blocks" if setup.reshard else "whole model until backward ends",
            )
        )
        # Micro-batches without gradient sync keep unsharded gradients, upcast to the fp32 reduce dtype (FSDP2).
        accumulate = 4 * total if setup.update_freq > 1 else 0
        items.append(
            Item(
                "gradient buffers",
                (cb + 4) * block + accumulate,
                0,
                "block grad + fp32 reduce-scatter" + (" + accumulated grads" if accumulate else ""),
            )
        )
        if setup.cpu_offload and hw.has_gpu:
            items.append(
                Item(
                    "offload staging",
                    2 * 4 * block_shard(stats, setup, hw.gpus_per_node),
                    0,
                    "a block's fp32 shard in, its fp32 reduce-scatter out",
                )
            )
    elif cb == 2 and not setup.memory_efficient_fp16:
        matmul = tp_numel(stats, "matmul", setup)
        items.append(Item("autocast weight copies", cb * matmul, 0, "cast once per forward"))
    if setup.bucketed_all_reduce:
        items.append(Item("gradient buffers", 2 * (64 << 20), 0, "64 MiB bucket, flat + reduced"))
    return [_to_host(i) for i in items] if not hw.has_gpu else items


def _to_host(item: Item) -> Item:
    return Item(item.name, 0, item.gpu + item.host, item.note)


def layer_share(setup: Setup) -> float:
    """The share of one block's traced activations a tensor-parallel rank saves: 1/M with sequence parallelism;
    without it the norms' and dropouts' inputs (about 30% of a block's bytes) stay whole on every rank."""
    M = setup.mp
    return 1.0 / M if setup.sequence_parallel else 0.3 + 0.7 / M


def activation_bytes(stats: ModelStats, setup: Setup) -> Tuple[int, int]:
    """(saved for backward at the end of forward, the largest backward transient) per rank.

    The transient is the larger of the head's (the logits' gradient, with the logits still saved)
    and one block's backward (its recomputed activations under checkpointing, all alive at once,
    plus the fp32 gradient flowing in and out of it); :mod:`toolkit.plan.update_peak` places both.
    """
    act, b, M = stats.activations, setup.rank_sequences, setup.mp
    share = layer_share(setup)
    per_layer = act.block_input / M if setup.checkpoint else act.per_layer * share
    saved = b * (stats.num_layers * per_layer + act.rest / M)
    recompute = b * act.per_layer * share if setup.checkpoint else 0
    flow = 2 * b * stats.tokens_per_sample * stats.embed_dim * 4 / (M if setup.sequence_parallel else 1)
    flow += expert_exchange(stats, setup)
    logits_grad = b * stats.tokens_per_sample * stats.vocab_size / M * (4 + setup.compute_bytes)
    return int(saved), int(max(recompute + flow, logits_grad))


def context_parallel_held(stats: ModelStats, setup: Setup, has_gpu: bool) -> Tuple[int, int]:
    """(one layer's gathered keys/values from the other cp ranks, the layout's mask) per rank, in bytes.

    ``toolkit.distributed.context_parallel`` all-gathers each layer's k and v over the whole sequence and the
    attention keeps them for backward: (C-1)/C of 2 x T x G x D per sequence beyond this rank's own (already in
    the T/C tokens' activations); every layer's until backward, or the recomputed layer's alone under
    checkpointing. On a GPU the attention runs under a bool [B or 1, 1, T/C, T] mask (B rows with
    --document-attention-mask), built once per micro-batch; on CPU it goes tile by tile (no such mask)."""
    if setup.cp == 1:
        return 0, 0
    T, C = stats.tokens_per_sample, setup.cp
    per_layer = stats.kv_width / stats.num_layers / setup.mp  # keys and values are split by heads under TP
    gathered = setup.batch_sequences * T * per_layer * setup.compute_bytes * (C - 1) / C
    rows = setup.batch_sequences if setup.document_mask else 1
    return int(gathered), (rows * (T // C) * T if has_gpu else 0)


def context_parallel_items(stats: ModelStats, setup: Setup, hw: Hardware) -> List[Item]:
    gathered, mask = context_parallel_held(stats, setup, hw.has_gpu)
    if setup.cp == 1:
        return []
    layers = 1 if setup.checkpoint else stats.num_layers
    items = [
        Item(
            "gathered keys/values (cp)",
            gathered * layers if hw.has_gpu else 0,
            0 if hw.has_gpu else gathered * layers,
            f"{'the recomputed layer' if setup.checkpoint else f'{layers} layers'}, (C-1)/C of T x 2G x D",
        )
    ]
    if mask:
        rows = " per sequence" if setup.document_mask else ""
        items.append(Item("context-parallel mask", mask, 0, f"bool T/C x T{rows}"))
    return items


def activation_items(stats: ModelStats, setup: Setup, hw: Hardware) -> List[Item]:
    saved, transient = activation_bytes(stats, setup)
    note = f"{setup.batch_sequences} x {stats.tokens_per_sample} tokens" + (f" / cp {setup.cp}" if setup.cp > 1 else "")
    note += ", checkpointed" if setup.checkpoint else ""
    on_host = setup.offload_activations or not hw.has_gpu
    items = [
        Item("activations (saved)", 0 if on_host else saved, saved if on_host else 0, note),
        Item(
            "backward transient",
            transient if hw.has_gpu else 0,
            0 if hw.has_gpu else transient,
            "max(recomputed block + gradient flow, logits grad)"
            if setup.checkpoint
            else "max(gradient flow, logits grad)",
        ),
    ]
    return items


def memory_items(stats: ModelStats, setup: Setup, hw: Hardware) -> List[Item]:
    items = (
        model_state_items(stats, setup, hw)
        + buffer_items(stats, setup, hw)
        + activation_items(stats, setup, hw)
        + context_parallel_items(stats, setup, hw)
    )
    if hw.has_gpu:
        items.append(Item("runtime", GPU_RUNTIME, HOST_RUNTIME, "CUDA context, libraries", True))
    return items
