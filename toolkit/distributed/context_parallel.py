"""Context parallelism (``--context-parallel-size C``): each sequence of a batch is cut over the C ranks of
the ``cp`` axis, and attention gathers the keys/values of the whole sequence from them.

The layout (load-balanced, as Megatron and torchtitan): the T positions are cut into 2C equal chunks and
cp rank r holds chunks r and 2C-1-r, in that order. Under a causal mask chunk i attends to i+1 chunks, so
every rank does the same attention work ((r+1) + (2C-r) = 2C+1 chunk pairs each), where a plain cut in C
pieces would give the last rank 2C-1 times the first one's.

What changes per micro-batch (:func:`shard_sample`, called by the strategy before the criterion):

- ``src_tokens`` and ``target``: this rank's T/C columns, in layout order; the loss is summed over them
  and the trainer's sums over ``dp x cp`` (``dims.group(*DP_AXES)``) add the other chunks' tokens, so
  the loss, ``ntokens`` and the gradients equal one process's on the whole sequence;
- ``positions``: each column's *global* rotary position (the chunk's own place in the sequence, or the
  restarted per-document positions of ``--reset-position-ids``), so RoPE sees what one process sees;
- ``context_parallel``: a :class:`ContextShard`, which the model passes to its attention layers beside their
  inputs (:meth:`ContextShard.attend` runs the attention package's ``attend_across_ranks``):
  :meth:`ContextShard.gather` all-gathers each layer's keys/values (its variant's entries) over the cp group
  (autograd sends the keys' gradients back to the rank that computed them), and :meth:`ContextShard.visibility`
  says which gathered key each of this rank's queries sees: causal on the global sequence index, within each
  document (``--document-attention-mask``, documents crossing chunk boundaries included) and within the sliding
  window of the layer asking.

The attention arithmetic over the gathered keys (tile by tile with the CPU flash kernel, or under the [T/C, T]
mask) is the attention package's (``toolkit.models.common.attention.across_ranks``); this module holds the layout
and the communication.

Why all-gather, not a ring: keys/values are H/G times smaller than queries under grouped-query attention and
the gather is one collective per layer (gloo does not overlap send/recv with compute on CPU anyway); the
backward sums the keys' gradients over the group (an all-reduce: gloo has no reduce-scatter). A sequence
whose length is not a multiple of 2C is padded at its end (padding tokens, targets ignored by the loss;
causal, so no real position sees them).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from toolkit.core.errors import UserError
from toolkit.models.common.attention import ChunkedVisibility, attend_across_ranks


def chunk_layout(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The sequence indices cp rank ``cp_rank`` holds: chunks r and 2C-1-r of 2C (``seq_len`` a multiple of 2C)."""
    chunk = seq_len // (2 * cp_size)
    if chunk * 2 * cp_size != seq_len:
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x {cp_size} context-parallel ranks")
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def check_sequence_split(cp_size: int, task: Any, model: Any, bos_prepended: Optional[bool] = None) -> None:
    """``--tokens-per-sample`` makes samples that cut into 2C equal chunks: a sample of another length is padded
    to the next multiple of 2C (:func:`pad_to_chunks`), which the model's positions must hold. Refused here, in
    one line naming both flags and the nearest lengths that cut, before any rank starts (``toolkit-train``'s
    flag checks and the planner call it): otherwise each rank dies in its first forward with an IndexError.
    ``bos_prepended``: whether ``--add-bos-token`` adds a position (fairseq's ``<s>``; not when a tokenizer's
    vocabulary reads BOS as context, which the caller knows from the data-bin); default: it does."""
    tokens = getattr(task, "tokens_per_sample", None)
    if cp_size <= 1 or not tokens:
        return
    bos = int(bool(getattr(task, "add_bos_token", False) if bos_prepended is None else bos_prepended))
    positions = getattr(model, "max_target_positions", None) or tokens + bos
    longest = positions if getattr(task, "sample_break_mode", "none") == "eos" else tokens + bos
    chunks = 2 * cp_size
    if -(-longest // chunks) * chunks <= positions:
        return
    nearest = sorted({n * chunks - bos for n in (longest // chunks, -(-longest // chunks))} - {0, -1})
    with_bos = " (with --add-bos-token's <s>)" if bos else ""
    raise UserError(
        f"--tokens-per-sample {tokens} with --context-parallel-size {cp_size}: each sample is cut into "
        f"{chunks} equal chunks (2 x {cp_size} ranks), so its {longest} positions{with_bos} must be a multiple "
        f"of {chunks}; use --tokens-per-sample {' or '.join(map(str, nearest))}"
        + (f" (or raise --max-target-positions {positions})" if getattr(model, "max_target_positions", None) else "")
    )


def gathered_layout(seq_len: int, cp_size: int) -> torch.Tensor:
    """The sequence indices of the gathered keys: every rank's :func:`chunk_layout`, rank after rank."""
    return torch.cat([chunk_layout(seq_len, cp_size, r) for r in range(cp_size)])


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dim (-2) over the cp group; backward: the summed gradient of this rank's part."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, cp_rank: int, cp_size: int) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(cp_size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.group, ctx.cp_rank, ctx.cp_size = group, cp_rank, cp_size
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # every rank's queries read this rank's keys: their gradients are summed (gloo has no reduce_scatter)
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.cp_size, dim=-2)[ctx.cp_rank].contiguous(), None, None, None


class ContextShard:
    """This rank's share of one micro-batch's sequences, passed by the model to each attention layer: the gathering
    of the layers' keys/values over the cp group, and their visibility (``KeyExchange`` of the attention package).

    ``group=None`` with ``cp_size`` 1 is one process's attention through the same path (the tests use it).
    """

    def __init__(
        self,
        seq_len: int,
        cp_size: int,
        cp_rank: int,
        group: Any = None,
        document_ids: Optional[torch.Tensor] = None,
        device: Any = None,
        target: Optional[torch.Tensor] = None,
    ):
        """``target``: the micro-batch's whole target rows [B, T], for what reads tokens ahead of this rank's
        chunks (multi-token prediction, ``toolkit.models.common.mtp``)."""
        self.cp_size, self.cp_rank, self.group = cp_size, cp_rank, group
        self.target = target
        self.query_index = chunk_layout(seq_len, cp_size, cp_rank).to(device)
        self.key_index = gathered_layout(seq_len, cp_size).to(device)
        self.document_ids = document_ids
        self._visibility: Dict[Optional[int], ChunkedVisibility] = {}

    def visibility(self, window: Optional[int] = None) -> ChunkedVisibility:
        """This rank's queries over the gathered keys, for a layer of ``window`` (built once per window)."""
        if window not in self._visibility:
            self._visibility[window] = ChunkedVisibility(self.query_index, self.key_index, self.document_ids, window)
        return self._visibility[window]

    def with_documents(self, document_ids: torch.Tensor) -> ContextShard:
        """The same layout over other rows' ``document_ids`` [b, T] (a pipeline's micro-batch of the sample's
        rows), its visibility built anew from them."""
        rows = copy.copy(self)
        rows.document_ids, rows._visibility = document_ids, {}
        return rows

    def gather(self, entries: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]:
        """Each entry [..., T/C, D] on each rank -> [..., T, D] in :func:`gathered_layout` order: one collective
        when the entries have one shape (k and v), one each otherwise."""
        if self.cp_size == 1:
            return tuple(entries)
        if all(e.shape == entries[0].shape for e in entries):
            return tuple(self._gather(torch.stack(entries)).unbind(0))
        return tuple(self._gather(e) for e in entries)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherSequence.apply(x, self.group, self.cp_rank, self.cp_size)

    @torch.compiler.disable
    def attend(self, layer: Any, q: torch.Tensor, entries: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The attention package's ``attend_across_ranks`` through this shard, eager under ``--compile`` (its
        docstring says why). Decorated at import (this module is imported only by context-parallel runs): one function
        object, so the compiled blocks' guards on it hold from one micro-batch's shard to the next."""
        return attend_across_ranks(layer, q, entries, self)


def pad_to_chunks(sample: Dict[str, Any], cp_size: int, pad: int) -> Dict[str, Any]:
    """The sample with its columns padded to a multiple of 2C (padding tokens and targets, document ids of
    the row's last document, positions 0); unchanged when they already are."""
    T = sample["net_input"]["src_tokens"].size(1)
    extra = -T % (2 * cp_size)
    if extra == 0:
        return sample

    def widen(x: torch.Tensor, value: Optional[int]) -> torch.Tensor:
        fill = x[:, -1:].expand(-1, extra) if value is None else x.new_full((x.size(0), extra), value)
        return torch.cat([x, fill], dim=1)

    net_input = dict(sample["net_input"], src_tokens=widen(sample["net_input"]["src_tokens"], pad))
    if "document_ids" in net_input:
        net_input["document_ids"] = widen(net_input["document_ids"], None)
    if "positions" in net_input:
        net_input["positions"] = widen(net_input["positions"], 0)
    return dict(sample, net_input=net_input, target=widen(sample["target"], pad))


def shard_sample(sample: Dict[str, Any], cp_size: int, cp_rank: int, group: Any, pad: int) -> Dict[str, Any]:
    """This cp rank's micro-batch (see the module docstring): its columns, their global positions, the counts
    of its own targets (``nsentences`` on cp rank 0 only, so the sums over the cp group count each row once)."""
    sample = pad_to_chunks(sample, cp_size, pad)
    net_input, target = sample["net_input"], sample["target"]
    tokens = net_input["src_tokens"]
    B, T = tokens.shape
    shard = ContextShard(T, cp_size, cp_rank, group, net_input.get("document_ids"), tokens.device, target)
    index = shard.query_index
    positions = net_input.get("positions")
    positions = index.expand(B, -1) if positions is None else positions[:, index]
    local = dict(net_input, src_tokens=tokens[:, index], positions=positions.contiguous(), context_parallel=shard)
    local.pop("document_ids", None)
    target = target[:, index]
    return dict(
        sample,
        net_input=local,
        target=target,
        ntokens=int(target.ne(pad).sum()),
        nsentences=sample.get("nsentences", B) if cp_rank == 0 else 0,
    )


__all__ = ["ContextShard", "chunk_layout", "gathered_layout", "shard_sample", "pad_to_chunks"]
