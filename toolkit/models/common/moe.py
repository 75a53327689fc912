"""Mixture-of-experts feed-forward: a router picks k of E gated experts per token (SwiGLU in Qwen3-MoE, OLMoE,
Mixtral, DeepSeek-V3; the activation a name of ``mlp.ACTIVATIONS``), with optional shared experts every token
goes through.

Shape notation: N tokens (B x T flattened), C model width, F an expert's hidden width, E experts, k experts a token.

Router (``Router``, parameter ``weight`` [E, C]: Hugging Face's ``gate``):

- ``softmax``: probabilities over the E experts, the top k kept; ``renormalize`` divides the k kept by their
  sum (Qwen3-MoE's ``norm_topk_prob``, Mixtral), else they are used as they are (OLMoE, Qwen3-MoE's default);
- ``sigmoid`` (DeepSeek-V3): independent scores per expert; with ``balance_bias`` a per-expert bias
  (buffer ``expert_bias``, not a parameter: no gradient) is added to the scores to *choose* the experts,
  the weights stay the unbiased scores. After every update the bias moves by ``bias_update_rate`` towards
  the under-loaded experts: ``b_i += rate * sign(mean load - load_i)`` (aux-loss-free balancing), the loads
  counted over the update's micro-batches and summed over all ranks, so every rank keeps the same bias
  (``routing_bias`` keeps the bias without moving it: an imported DeepSeek-V3's correction bias);
- DeepSeekMoE's group limit (``groups`` > 1): the E experts form ``groups`` groups of consecutive experts, each
  group scored by the sum of its 2 highest (biased) scores, and a token's k experts are chosen among those of
  its ``top_groups`` best groups only (DeepSeek-V3: 8 groups, 4 kept; on a cluster, a group's experts share a
  node, so a token's experts span ``top_groups`` nodes at most);
- ``scaling`` multiplies the weights after any renormalization (DeepSeek-V3's ``routed_scaling_factor`` 2.5:
  sigmoid weights renormalized to sum 1 are small against the shared expert's output).

Dispatch is dropless: the N*k (token, expert) pairs are sorted by expert (a stable sort, so each expert sees
its tokens in order), each expert multiplies its contiguous run of rows, and the outputs, scaled by the
router weights, are added back to their tokens. The experts are stored stacked (``gate_proj``, ``up_proj``
[E, F, C], ``down_proj`` [E, C, F]: Hugging Face's per-expert matrices, one above the other), so the runs
go through one grouped GEMM (``torch._grouped_mm``, public as ``F.grouped_mm``) on CUDA in bf16 and on the
CPU in fp32/bf16, and otherwise (fp16, widths not 16-byte aligned) through one matmul per expert: the same
products (the tests check the two paths bit for bit). Where the run selected oneDNN for fp32 CPU products
(``--cpu-matmul``, ``toolkit.ops``) and the experts' runs are big enough to gain, fp32 runs go through it one
expert at a time instead (``ops.grouped_linear``). Otherwise, in an eager CPU forward over every expert, the runs are
padded to the longest one and go through one batched matmul per projection (``GroupedExperts.run_padded``): the
CPU's grouped GEMM is one matmul per expert, each a parallel region, and the threads' E barriers forward and 2E
backward cost more than the padding while it stays under ``PADDING_LIMIT`` times the rows.

Expert parallelism (``--expert-parallel-size P``, :meth:`GroupedExperts.place`): each of P ranks keeps E/P
consecutive experts. The router still scores all E on every rank; a rank's rows, already sorted by expert, go
in P contiguous runs to the ranks owning them (``all_to_all_single``: the counts first, then the rows), are
computed there and come back by a second exchange in the same order, so the combine below is unchanged.
Backward sends the gradients along the same splits reversed (:class:`_Exchange`). The routing statistics
(counts, aux losses, bias update) are taken before the dispatch, as in one process.

Under tensor parallelism the layer is not split: each tp rank holds it whole. With sequence parallelism a rank
routes only its slice of the positions, so the statistics below are summed over the tp ranks
(``MoE.sequence_group``, set by ``toolkit.distributed.expert_parallel``) and equal one process's, except in a
batch whose length sequence parallelism right-pads to a multiple of M (an epoch's short last block): the padding
positions are routed and counted too (their logits are cut, so they add nothing else). Under context parallelism
a rank routes its chunks of each sequence, and the statistics are summed over the cp ranks the same way
(``MoE.context_group``, set by the model from its context shard), except that each cp rank's loss is a part of the
whole: the gradient of a sum over cp ranks is the sum of every rank's (where sequence parallelism's tp ranks
each compute the whole loss). They equal one process's, except for the padding a sequence gets to a multiple of 2C.

Auxiliary terms, as ``toolkit.models.outputs`` carries them (``MoE.aux`` after a forward):

- load balancing (Switch Transformer / GShard): ``E * sum_i f_i * P_i``, f_i the fraction of the N*k
  assignments going to expert i, P_i the router's mean probability of i (1.0 when balanced);
- router z-loss (ST-MoE): ``mean_n logsumexp(router logits_n)^2``;
- metrics: the busiest expert's load over the mean load, and the tokens dropped (0: nothing is dropped).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from toolkit import ops
from toolkit.core.dtensor import is_dtensor
from toolkit.models.common.mlp import ACTIVATIONS, FEED_FORWARDS, GatedFeedForward
from toolkit.models.common.options import SCORE_FUNCTIONS

logger = logging.getLogger("toolkit.moe")


@dataclass
class Routing:
    """One forward's routing: ``weights`` [N, k] (the input's dtype), ``experts`` [N, k], ``logits`` and
    ``probs`` [N, E] in fp32 (``probs``: the scores normalized over the experts, what the balance loss reads)."""

    weights: torch.Tensor
    experts: torch.Tensor
    logits: torch.Tensor
    probs: torch.Tensor


class Router(nn.Module):
    """Top-k gate over E experts (see the module docstring for the score functions and the bias)."""

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        score_func: str = "softmax",
        renormalize: bool = False,
        balance_bias: bool = False,
        groups: int = 1,
        top_groups: int = 1,
        scaling: float = 1.0,
    ):
        super().__init__()
        if score_func not in SCORE_FUNCTIONS:
            raise ValueError(f"score_func {score_func!r}: one of {SCORE_FUNCTIONS}")
        if groups < 1 or num_experts % groups or not 1 <= top_groups <= groups:
            raise ValueError(f"{groups} groups, {top_groups} kept: groups must divide the {num_experts} experts")
        if not 1 <= top_k <= (num_experts // groups) * (top_groups if groups > 1 else 1):
            raise ValueError(f"top_k {top_k}: between 1 and the experts of the kept groups")
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.renormalize = score_func, renormalize
        self.groups, self.top_groups, self.scaling = groups, top_groups, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        if balance_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts))  # saved: part of the model's state
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> Routing:
        """x [N, C] -> the k experts of each token and their weights."""
        logits = F.linear(x, self.weight).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias.float()
        if self.groups > 1:
            choice = self.within_top_groups(choice)
        experts = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        probs = scores if self.score_func == "softmax" else scores / scores.sum(-1, keepdim=True)
        return Routing(weights.to(x.dtype), experts, logits, probs)

    def within_top_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [N, E] with the experts outside each token's ``top_groups`` best groups at -inf (a group's score:
        the sum of its 2 highest)."""
        N, E = choice.shape
        grouped = choice.view(N, self.groups, E // self.groups)
        group_scores = grouped.topk(min(2, E // self.groups), dim=-1).values.sum(-1)  # [N, groups]
        kept = torch.topk(group_scores, self.top_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, kept, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(N, E)


def expert_runs(x: torch.Tensor, experts: torch.Tensor, num_experts: int):
    """The N*k (token, expert) pairs sorted by expert: (rows of x in that order [N*k, C], the pair each row is
    (an index into ``experts.flatten()``), tokens per expert [E])."""
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return x[order // experts.size(1)], order, counts


# The CPU's padded form (``GroupedExperts.run_padded``) runs while its rows, every expert padded to the longest run,
# are at most this many times the (token, expert) pairs; a more uneven routing keeps the runs (each expert's own).
PADDING_LIMIT = 1.5


class Slots(NamedTuple):
    """The (token, expert) pairs laid out by expert, each expert's run padded to ``cap`` rows: ``pairs`` [E cap],
    slot ``e * cap + j`` holding the index into ``experts.flatten()`` of expert e's j-th pair (in token order), a
    padding slot N k; ``counts`` [E] the pairs per expert."""

    pairs: torch.Tensor
    counts: torch.Tensor
    cap: int


def padded_slots(experts: torch.Tensor, num_experts: int, limit: float = PADDING_LIMIT) -> Optional[Slots]:
    """:class:`Slots` of ``experts`` [N, k]; None where the padded rows would exceed ``limit`` times the pairs."""
    flat = experts.flatten()
    counts = torch.bincount(flat, minlength=num_experts)
    cap = int(counts.max()) if flat.numel() else 0
    if cap == 0 or num_experts * cap > limit * flat.numel():
        return None
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    starts = torch.cumsum(counts, 0) - counts
    slot = by_expert * cap + torch.arange(flat.numel(), device=flat.device) - starts[by_expert]
    pairs = torch.full((num_experts * cap,), flat.numel(), dtype=torch.long, device=flat.device)
    return Slots(pairs.index_put_((slot,), order), counts, cap)


def grouped_matmul(rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """rows [M, in] in runs of ``counts`` [E] rows, run e times ``weights[e]`` [out, in]^T -> [M, out]: one grouped
    GEMM (``torch._grouped_mm``; CUDA in bf16, CPU in fp32 or bf16) where its kernel takes the shapes, else
    :func:`per_expert_matmul` (the same products). Under ``torch.compile`` (``--compile``) anything but bf16 goes
    through the opaque ``toolkit::grouped_matmul`` op (the kernel's compiled form takes bf16 only, and the
    per-expert split has data-dependent sizes), which runs this same eager code."""
    rows, weights = _autocast_operands(rows, weights)
    if torch.compiler.is_compiling() and not (rows.dtype == torch.bfloat16 and _grouped_mm_applies(rows, weights)):
        return _opaque_grouped_matmul(rows, weights, counts)
    return _eager_grouped_matmul(rows, weights, counts)


def _autocast_operands(rows: torch.Tensor, weights: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both operands in autocast's dtype, as autocast casts a matmul's: it does not cover the grouped GEMM, and
    bf16 rows against fp32 master weights would miss the kernel (one small matmul per expert instead)."""
    kind = rows.device.type
    if kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
        return rows.to(dtype), weights.to(dtype)
    return rows, weights


def _eager_grouped_matmul(rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    if rows.is_meta and rows.dtype != torch.bfloat16:  # toolkit-plan's shape trace: the meta kernel takes bf16 only
        return _eager_grouped_matmul(rows.bfloat16(), weights.bfloat16(), counts).to(rows.dtype)
    by_onednn = ops.grouped_linear(rows, weights, counts)  # fp32, big runs, a CPU where oneDNN beats torch's BLAS
    if by_onednn is not None:
        return by_onednn
    if _grouped_mm_applies(rows, weights):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return GROUPED_MM(rows, weights.transpose(-2, -1), offs=offsets)
    return per_expert_matmul(rows, weights, counts)


@torch.library.custom_op("toolkit::grouped_matmul", mutates_args=())
def _opaque_grouped_matmul(rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return _eager_grouped_matmul(rows, weights, counts)


@_opaque_grouped_matmul.register_fake
def _(rows, weights, counts):
    return rows.new_empty(rows.size(0), weights.size(1))


@torch.library.custom_op("toolkit::grouped_matmul_backward", mutates_args=())
def _opaque_grouped_matmul_backward(
    rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor, grad: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """d rows = grad_e weights[e], d weights[e] = grad_e^T rows_e, run by run (an op runs below autograd)."""
    sizes = counts.tolist()
    by_onednn = ops.grouped_linear_grads(grad, rows, weights, sizes)
    if by_onednn is not None:
        return by_onednn
    grad_runs, row_runs = torch.split(grad, sizes), torch.split(rows, sizes)
    grad_rows = torch.cat([g @ weights[e] for e, g in enumerate(grad_runs)], dim=0)
    grad_weights = torch.stack([g.t() @ r for g, r in zip(grad_runs, row_runs)])
    return grad_rows, grad_weights


@_opaque_grouped_matmul_backward.register_fake
def _(rows, weights, counts, grad):
    return torch.empty_like(rows), torch.empty_like(weights)


def _setup_backward(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    rows, weights, counts = ctx.saved_tensors
    grad_rows, grad_weights = _opaque_grouped_matmul_backward(rows, weights, counts, grad)
    return grad_rows, grad_weights, None


_opaque_grouped_matmul.register_autograd(_backward, setup_context=_setup_backward)


GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _grouped_mm_applies(rows: torch.Tensor, weights: torch.Tensor) -> bool:
    """The kernel's conditions: bf16 on CUDA (fp32 or bf16 on CPU), rows of both operands 16-byte aligned; any
    dtype on the meta device."""
    if GROUPED_MM is None or rows.dtype != weights.dtype or rows.device.type not in ("cuda", "cpu", "meta"):
        return False
    if rows.is_meta:  # shapes only (toolkit-plan's trace): the per-expert split would need the counts' values
        return True
    dtypes = (torch.bfloat16,) if rows.is_cuda else (torch.float32, torch.bfloat16)
    aligned = all(width * rows.element_size() % 16 == 0 for width in (rows.size(1), weights.size(1)))
    return rows.dtype in dtypes and aligned


def per_expert_matmul(rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_matmul` as one matmul per expert (fp16, unaligned widths, other devices)."""
    runs = torch.split(rows, counts.tolist())
    return torch.cat([run @ weights[e].t() for e, run in enumerate(runs)], dim=0)


class _Exchange(torch.autograd.Function):
    """``all_to_all_single`` of rows in runs (``send`` rows to each rank, ``receive`` from each) that autograd
    goes through: the gradient of what arrived goes back to where it came from, the splits swapped."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: List[int], receive: List[int], group) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _all_to_all(rows, send, receive, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def _all_to_all(rows: torch.Tensor, send: List[int], receive: List[int], group) -> torch.Tensor:
    out = rows.new_empty(sum(receive), *rows.shape[1:])
    dist.all_to_all_single(out, rows.contiguous(), receive, send, group=group)
    return out


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _gather_experts(module: GroupedExperts, state: Dict, prefix: str, _metadata) -> None:
    """state_dict hook of placed experts: the whole [E, ...] stacks (collective: every rank saves)."""
    for name in module.STACKS:
        state[prefix + name] = module.whole_stack(state[prefix + name])


def _slice_experts(module: GroupedExperts, state: Dict, prefix: str, *_args) -> None:
    """load_state_dict pre-hook of placed experts: a whole stack keeps this rank's E/P experts (as this rank's
    FSDP2 shard of them when the experts are sharded: every rank holds the whole stack, so no communication)."""
    for name in module.STACKS:
        if prefix + name in state:
            part = module.own_part(_whole_local(state[prefix + name]))  # DCP may hand a replicated DTensor
            param = getattr(module, name)
            if is_dtensor(param):  # a DTensor: FSDP2 shards these experts over their peers
                from torch.distributed.tensor import distribute_tensor

                part = distribute_tensor(
                    part.to(param.device, param.dtype), param.device_mesh, param.placements, src_data_rank=None
                )
            state[prefix + name] = part


def _whole_local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's shard of this rank's experts) gathered over its mesh (collective); a tensor as it is."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


class GroupedExperts(nn.Module):
    """E gated experts stored stacked: ``gate_proj``, ``up_proj`` [E, F, C] and ``down_proj`` [E, C, F]; after
    :meth:`place`, this rank's E/P consecutive ones (``num_experts`` stays E, the router's count). ``STACKS``: the
    per-expert tensors [E, ...] that placement cuts (a subclass adds its experts' biases)."""

    STACKS = EXPERT_PROJECTIONS

    def __init__(self, num_experts: int, dim: int, hidden: int, activation: str = "silu"):
        super().__init__()
        self.num_experts = num_experts
        self.act = ACTIVATIONS[activation]
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.ep_group, self.ep_size, self.ep_rank = None, 1, 0

    @torch.no_grad()
    def place(self, group, rank: int, size: int) -> None:
        """Keep experts [rank E/P, (rank + 1) E/P) of the initialized stack; tokens are exchanged over ``group``."""
        if self.num_experts % size:
            raise ValueError(f"{self.num_experts} experts cannot be split evenly over {size} ranks")
        local = self.num_experts // size
        for name in self.STACKS:
            full = getattr(self, name)
            setattr(self, name, nn.Parameter(full[rank * local : (rank + 1) * local].clone()))
        self.ep_group, self.ep_size, self.ep_rank = group, size, rank
        # wrapped here, not at import: torch.compiler.disable imports dynamo, which a plain command does not need
        self._eager_exchange = torch.compiler.disable(self._exchange_and_run)
        self._register_state_dict_hook(_gather_experts)  # checkpoints hold the whole stack, loadable at any P
        self._register_load_state_dict_pre_hook(_slice_experts, with_module=True)

    def whole_stack(self, shard: torch.Tensor) -> torch.Tensor:
        """This rank's [E/P, ...] piece of a per-expert tensor (a weight, an optimizer moment) gathered over the ep
        ranks into [E, ...]; anything else (a scalar step count) as it is. Collective."""
        if shard.dim() == 0 or shard.size(0) != self.num_experts // self.ep_size:
            return shard
        shard = _whole_local(shard)  # under FSDP2, this rank's experts are first gathered from their peers
        shards = [torch.empty_like(shard) for _ in range(self.ep_size)]
        dist.all_gather(shards, shard.detach().contiguous(), group=self.ep_group)
        return torch.cat(shards)

    def initial_parts(self) -> Dict[str, Tuple[Tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]]:
        """Placed before initialization (on the meta device, under FSDP2): each stack's whole shape and the cut to
        this rank's experts, so ``init_weights`` draws the values of the whole stack, as one process does."""
        if self.ep_group is None:
            return {}
        return {name: ((self.num_experts, *getattr(self, name).shape[1:]), self.own_part) for name in self.STACKS}

    def own_part(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a whole [E, ...] per-expert tensor; anything else as it is."""
        if whole.dim() == 0 or whole.size(0) != self.num_experts:
            return whole
        local = self.num_experts // self.ep_size
        return whole[self.ep_rank * local : (self.ep_rank + 1) * local]

    def run_placed(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """:meth:`run` with the experts spread over the ep ranks: ``counts`` [E] of all experts; rows go to their
        experts' rank and come back in the same order."""
        if self.ep_group is None:
            return self.run(rows, counts)
        return self._eager_exchange(rows, counts)

    def _exchange_and_run(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The exchange, always eager (``_eager_exchange``): its row counts per rank are known only after routing
        (``.tolist()`` of a collective's result), so under ``--compile`` the block's graph stops before it and
        resumes after it."""
        P, local = self.ep_size, self.num_experts // self.ep_size
        arriving = torch.empty_like(counts)  # [P * local]: from rank s, the rows for my expert e at s * local + e
        dist.all_to_all_single(arriving, counts, group=self.ep_group)
        send, receive = counts.view(P, local).sum(1).tolist(), arriving.view(P, local).sum(1).tolist()
        arrived = _Exchange.apply(rows, send, receive, self.ep_group)
        expert_of_row = torch.arange(local, device=rows.device).repeat(P).repeat_interleave(arriving)
        order = torch.argsort(expert_of_row, stable=True)  # by expert, each expert's rows by source rank
        out = self.run(arrived[order], arriving.view(P, local).sum(0))
        return _Exchange.apply(out[torch.argsort(order)], receive, send, self.ep_group)

    def run(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [M, C] sorted by expert, ``counts`` [E] -> each row through its expert [M, C]."""
        hidden = self.act(grouped_matmul(rows, self.gate_proj, counts)) * grouped_matmul(rows, self.up_proj, counts)
        return grouped_matmul(hidden, self.down_proj, counts)

    def batches(self, x: torch.Tensor) -> bool:
        """Whether :meth:`run_padded` takes this forward: eager on the CPU, every expert here (no expert
        parallelism), no autocast (its bf16 copies of the padded rows raise the peak toolkit-plan predicts), plain
        tensors, these experts' own ``run`` (a subclass with another keeps the runs), and no
        oneDNN selected for the products (it takes the runs one at a time, ``ops.grouped_linear``)."""
        tensors = (x, self.gate_proj, self.up_proj, self.down_proj)
        return (
            x.device.type == "cpu"
            and self.ep_group is None
            and type(self).run is GroupedExperts.run
            and not torch.compiler.is_compiling()
            and not torch.is_autocast_enabled("cpu")
            and not any(is_dtensor(t) for t in tensors)
            and not ops.uses_onednn(*tensors)
        )

    def run_padded(self, x: torch.Tensor, weights: torch.Tensor, slots: Slots) -> torch.Tensor:
        """The weighted sum of :meth:`forward` with each expert's rows padded to the longest run: [E, cap, C] through
        one batched matmul per projection (``torch.bmm``). Why: torch's grouped GEMM on the CPU is one matmul per
        expert, each a parallel region whose threads meet at a barrier (E times the barriers forward, 2E backward,
        the cost that dominates on a busy machine), for the same products. A padding slot reads a row of zeros
        (the row after the tokens) and writes to a row that is dropped: it adds nothing to any value or
        gradient."""
        N, E, k = x.size(0), self.num_experts, weights.size(1)
        tokens = torch.div(slots.pairs, k, rounding_mode="floor")  # [E cap]; a padding slot: N
        rows = torch.cat([x, x.new_zeros(1, x.size(1))]).index_select(0, tokens).view(E, slots.cap, -1)
        hidden = self.act(torch.bmm(rows, self.gate_proj.transpose(1, 2))) * torch.bmm(
            rows, self.up_proj.transpose(1, 2)
        )
        out = torch.bmm(hidden, self.down_proj.transpose(1, 2)).flatten(0, 1)  # [E cap, C]
        scale = torch.cat([weights.flatten(), weights.new_zeros(1)])[slots.pairs, None]
        # accumulated by index_put_: one parallel region, where index_add_ takes several
        summed = x.new_zeros(N + 1, x.size(1)).index_put_((tokens,), (out * scale).to(x.dtype), accumulate=True)
        return summed[:N]

    def every_expert(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The same sum with every expert run on every token, the unchosen ones weighted 0: no sort, no data-dependent
        shape, so an exported graph (``toolkit-export --format onnx``) can hold it; E/k times the FLOPs."""
        combine = torch.zeros(x.size(0), self.num_experts, dtype=x.dtype, device=x.device)
        combine = combine.scatter(1, routing.experts, routing.weights)  # [N, E]
        hidden = self.act(torch.einsum("nc,efc->enf", x, self.gate_proj)) * torch.einsum("nc,efc->enf", x, self.up_proj)
        return torch.einsum("enf,ecf,ne->nc", hidden, self.down_proj, combine)

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x [N, C] -> sum over each token's k experts of weight * expert(x) [N, C]; also the tokens per expert
        (None in an exported graph, which runs :meth:`every_expert`)."""
        # An exported graph is an inference graph; torch 2.11's is_exporting() is also True under torch.compile
        # (pytorch/pytorch#176347), where training must take the dropless dispatch below.
        if (torch.compiler.is_exporting() and not self.training) or torch.onnx.is_in_onnx_export():
            return self.every_expert(x, routing), None
        slots = padded_slots(routing.experts, self.num_experts) if self.batches(x) else None
        if slots is not None:
            return self.run_padded(x, routing.weights, slots), slots.counts
        rows, order, counts = expert_runs(x, routing.experts, self.num_experts)
        out = self.run_placed(rows, counts) * routing.weights.flatten()[order, None]
        tokens = order // routing.experts.size(1)
        return torch.zeros_like(x).index_add_(0, tokens, out.to(x.dtype)), counts


def load_balancing_loss(
    probs: torch.Tensor, counts: torch.Tensor, top_k: int, group=None, context_group=None
) -> torch.Tensor:
    """Switch/GShard: E * sum_i f_i * P_i, f_i = counts_i / (N k) (no gradient), P_i = mean_n probs[n, i]; with a
    ``group`` (sequence parallelism) or a ``context_group`` (context parallelism) the N tokens are those of every
    rank of it, counts and probabilities summed."""
    if group is None and context_group is None:
        fraction = counts.float() / (probs.size(0) * top_k)
        return probs.size(1) * (fraction.detach() * probs.mean(0)).sum()
    tokens = sum_over_ranks(probs.new_tensor(float(probs.size(0))), group, context_group)
    fraction = sum_over_ranks(counts.float().detach(), group, context_group) / (tokens * top_k)
    return probs.size(1) * (fraction * sum_over_ranks(probs.sum(0), group, context_group) / tokens).sum()


def sequence_balance_loss(
    probs: torch.Tensor, experts: torch.Tensor, sequences: int, group=None, context_group=None
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (arXiv 2412.19437, eq. 17-20), before its alpha: per sequence of T
    tokens, sum_i f_i P_i with f_i = E / (k T) x the tokens of the sequence routed to expert i (no gradient) and
    P_i = mean_t probs[t, i] (the scores normalized over the experts); the mean over the sequences (1.0 when
    each sequence is balanced). ``probs`` [B T, E], ``experts`` [B T, k], the rows sequence by sequence; with a
    ``group`` or ``context_group`` each rank holds a slice of every sequence, whose sums are summed over it."""
    E, k = probs.size(1), experts.size(1)
    chosen = torch.zeros_like(probs).scatter_(1, experts, 1.0).view(sequences, -1, E)  # [B, T, E]
    tokens = probs.new_tensor(float(chosen.size(1)))
    counts, summed = chosen.sum(1).detach(), probs.view(sequences, -1, E).sum(1)  # [B, E]
    if group is not None or context_group is not None:
        tokens, counts = sum_over_ranks(tokens, group, context_group), sum_over_ranks(counts, group, context_group)
        summed = sum_over_ranks(summed, group, context_group)
    fraction = counts * E / (k * tokens)
    return (fraction * summed / tokens).sum(1).mean()


def router_z_loss(logits: torch.Tensor, group=None, context_group=None) -> torch.Tensor:
    """ST-MoE's z-loss: mean over tokens of logsumexp(router logits)^2, which keeps the logits small (with a
    ``group`` or ``context_group``: over the tokens of every rank of it)."""
    squares = torch.logsumexp(logits.float(), dim=-1).square()
    if group is None and context_group is None:
        return squares.mean()
    count = squares.new_tensor(float(squares.numel()))
    return sum_over_ranks(squares.sum(), group, context_group) / sum_over_ranks(count, group, context_group)


def sum_over_ranks(tensor: torch.Tensor, group, context_group=None) -> torch.Tensor:
    """``tensor`` summed over ``group`` (sequence parallelism: the gradient passed back to this rank's part
    unchanged), then over ``context_group`` (context parallelism: the gradient summed over its ranks); None: as
    it is."""
    if group is not None:
        tensor = _SumOverRanks.apply(tensor, group, False)
    if context_group is not None:
        tensor = _SumOverRanks.apply(tensor, context_group, True)
    return tensor


class _SumOverRanks(torch.autograd.Function):
    """All-reduce. Backward, over sequence-parallel ranks, the identity: every rank of the group computes the same
    loss from the sum, and the gradient of that one loss with respect to this rank's part is the gradient with
    respect to the sum (the parameters' gradients of the ranks are then added, as sequence-parallel gradients are).
    Over context-parallel ranks (``sum_gradients``) each rank's loss is a part of the whole (the losses are added),
    so this rank's part gets the sum of every rank's gradient with respect to the sum."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group, sum_gradients: bool) -> torch.Tensor:
        ctx.group, ctx.sum_gradients = group, sum_gradients
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.sum_gradients:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class MoE(nn.Module):
    """Router + stacked experts (+ shared experts): [B, T, C] -> [B, T, C], dropless.

    After each training forward ``self.aux`` holds this layer's ``balance`` and ``z`` losses (0-dim, in the graph)
    and ``self.load`` its load metrics; the family's model hands them to the criterion. The tokens each expert
    received are summed over the update's micro-batches (``tokens_per_expert``) for ``after_optimizer_step``:
    the aux-loss-free bias update and the warning about an expert that got no token for ``idle_warning_updates``
    updates in a row.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        bias: bool = False,
        num_experts: int = 8,
        top_k: int = 2,
        score_func: str = "softmax",
        renormalize: bool = False,
        shared_hidden: int = 0,
        bias_update_rate: float = 0.0,
        idle_warning_updates: int = 100,
        name: str = "moe",
        activation: str = "silu",
        groups: int = 1,
        top_groups: int = 1,
        routed_scaling: float = 1.0,
        routing_bias: bool = False,
        sequence_balance: bool = False,
    ):
        """See the module docstring; ``routing_bias``: the router has the bias even where it does not move
        (``bias_update_rate`` 0); ``sequence_balance``: ``aux`` holds DeepSeek-V3's sequence-wise balance loss too
        (``sequence_balance``)."""
        super().__init__()
        if bias:
            raise ValueError("MoE experts have no biases")
        self.name, self.bias_update_rate, self.idle_warning_updates = name, bias_update_rate, idle_warning_updates
        self.sequence_balance = sequence_balance
        self.gate = Router(
            dim,
            num_experts,
            top_k,
            score_func,
            renormalize,
            balance_bias=routing_bias or bias_update_rate > 0,
            groups=groups,
            top_groups=top_groups,
            scaling=routed_scaling,
        )
        self.experts = GroupedExperts(num_experts, dim, hidden, activation)
        self.shared_experts = GatedFeedForward(dim, shared_hidden, activation) if shared_hidden else None
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts), persistent=False)
        self.register_buffer("idle_updates", torch.zeros(num_experts, dtype=torch.long), persistent=False)
        self.aux: Dict[str, torch.Tensor] = {}
        self.load: Dict[str, torch.Tensor] = {}
        # sequence parallelism (set by toolkit.distributed.expert_parallel): this rank routes its slice of the
        # positions, and the routing statistics are summed over the ranks of the other slices
        self.sequence_group = None
        # context parallelism (set by the model from its context shard): this rank routes its chunks of each
        # sequence, and the routing statistics are summed over the cp ranks
        self.context_group = None
        # the ranks whose token counts the update's loads sum (None: every rank; a pipeline stage's ranks under
        # --pipeline-parallel-size, where the other stages hold other layers)
        self.count_group = None

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """No counts, no bias (after ``to_empty``; ``init_weights`` calls this; a checkpoint then loads the bias)."""
        self.tokens_per_expert.zero_()
        self.idle_updates.zero_()
        if self.gate.expert_bias is not None:
            self.gate.expert_bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)
        routing = self.gate(flat)
        y, counts = self.experts(flat, routing)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        if self.training:
            self._record(routing, counts, B)
        return y.view(B, T, C)

    def _record(self, routing: Routing, counts: torch.Tensor, sequences: int) -> None:
        group, context = self.sequence_group, self.context_group
        self.aux = {
            "balance": load_balancing_loss(routing.probs, counts, self.gate.top_k, group, context),
            "z": router_z_loss(routing.logits, group, context),
        }
        if self.sequence_balance:
            self.aux["sequence_balance"] = sequence_balance_loss(
                routing.probs, routing.experts, sequences, group, context
            )
        with torch.no_grad():
            self.tokens_per_expert += counts.float()  # this rank's: after_optimizer_step sums over every rank
            counts = sum_over_ranks(counts.float(), group, context)
            assigned = sum_over_ranks(counts.new_tensor(float(routing.experts.numel())), group, context)
            self.load = {"max_load": counts.max() / counts.mean(), "dropped": assigned - counts.sum()}

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """The update's loads (summed over the ranks): the bias moves towards the idle experts, idle streaks
        are counted and warned about; the counts start again at zero for the next update."""
        loads = self.tokens_per_expert.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(loads, group=self.count_group)
        self.tokens_per_expert.zero_()
        if loads.sum() == 0:  # no training forward since the last step (e.g. a skipped update)
            return
        if self.gate.expert_bias is not None:
            self.gate.expert_bias += self.bias_update_rate * torch.sign(loads.mean() - loads)
        self.idle_updates = torch.where(loads == 0, self.idle_updates + 1, torch.zeros_like(self.idle_updates))
        idle = (self.idle_updates == self.idle_warning_updates).nonzero().flatten().tolist()
        if idle:
            logger.warning(
                f"{self.name}: expert(s) {', '.join(map(str, idle))} received no token for "
                f"{self.idle_warning_updates} updates in a row (router collapse? raise "
                "--moe-aux-loss-coef or use --moe-bias-update-rate)"
            )


FEED_FORWARDS["moe"] = MoE
