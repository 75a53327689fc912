"""Context parallelism (``--context-parallel-size C``): each sequence of a batch is cut over the C ranks of
the ``cp`` axis, and attention gathers the keys/values of the whole sequence from them.

The layout (load-balanced, as Megatron and torchtitan): the T positions are cut into 2C equal chunks and
cp rank r holds chunks r and 2C-1-r, in that order. Under a causal mask chunk i attends to i+1 chunks, so
every rank does the same attention work ((r+1) + (2C-r) = 2C+1 chunk pairs each), where a plain cut in C
pieces would give the last rank 2C-1 times the first one's.

What changes per micro-batch (:func:`shard_sample`, called by the strategy before the criterion):

- ``src_tokens`` and ``target``: this rank's T/C columns, in layout order; the loss is summed over them
  and the trainer's sums over ``dp x cp`` (``ParallelDims.loss_group``) add the other chunks' tokens, so
  the loss, ``ntokens`` and the gradients equal one process's on the whole sequence;
- ``positions``: each column's *global* rotary position (the chunk's own place in the sequence, or the
  restarted per-document positions of ``--reset-position-ids``), so RoPE sees what one process sees;
- ``context_parallel``: a :class:`ContextShard`, which the model passes to its attention layers as the mask.
  :meth:`ContextShard.attend_across_ranks` all-gathers k and v over the cp group (autograd sends the keys'
  gradients back to the rank that computed them) and attends this rank's queries over them: causal on the
  global sequence index, within each document (``--document-attention-mask``, documents crossing chunk
  boundaries included: the masks compare the whole row's document ids) and within the sliding window of
  the layer asking.

The attention on CPU goes tile by tile: (query chunk, key chunk) pairs of c = T/2C positions, each through
torch's CPU flash kernel (``is_causal`` on the diagonal tile, no mask on the earlier chunks, an additive mask
only on tiles a document or window boundary crosses, hidden tiles skipped), merged by their log-sum-exp
(online softmax), so no [T/C, T] score or mask tensor exists. Elsewhere (and for soft-capped logits) the
toolkit's ``attend`` runs under the [T/C, T] mask of the layout.

Why all-gather, not a ring: keys/values are H/G times smaller than queries under grouped-query attention and
the gather is one collective per layer (gloo does not overlap send/recv with compute on CPU anyway); the
backward sums the keys' gradients over the group (an all-reduce: gloo has no reduce-scatter). A sequence
whose length is not a multiple of 2C is padded at its end (padding tokens, targets ignored by the loss;
causal, so no real position sees them).
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from toolkit.models.blocks.attention import attend


def chunk_layout(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The sequence indices cp rank ``cp_rank`` holds: chunks r and 2C-1-r of 2C (``seq_len`` a multiple of 2C)."""
    chunk = seq_len // (2 * cp_size)
    if chunk * 2 * cp_size != seq_len:
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2 x {cp_size} context-parallel ranks")
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def gathered_layout(seq_len: int, cp_size: int) -> torch.Tensor:
    """The sequence indices of the gathered keys: every rank's :func:`chunk_layout`, rank after rank."""
    return torch.cat([chunk_layout(seq_len, cp_size, r) for r in range(cp_size)])


def visible_keys(
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    document_ids: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    """bool [B or 1, 1, Tq, Tk]: query at sequence index q sees key k when k <= q, q - k < window and both are
    in the same document (``document_ids`` [B, T] of the whole row)."""
    q, k = query_index[:, None], key_index[None, :]
    mask = k <= q
    if window is not None:
        mask = mask & (q - k < window)
    mask = mask[None]
    if document_ids is not None:
        mask = mask & (document_ids[:, query_index, None] == document_ids[:, None, key_index])
    return mask[:, None]


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


class _Block(NamedTuple):
    """One (query chunk, key chunk) tile of this rank's attention: ``query`` 0 or 1 (this rank's first or second
    chunk), ``key`` the chunk's place among the gathered keys; ``causal``: the diagonal tile of a plain causal
    mask; ``mask``: the additive mask of a partly visible tile (None: all visible); ``blind``: [B or 1, 1, c] the
    rows that see no key of this tile (None: every row sees one)."""

    query: int
    key: int
    causal: bool
    mask: Optional[torch.Tensor]
    blind: Optional[torch.Tensor]


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _ChunkedAttention(torch.autograd.Function):
    """This rank's two query chunks over the gathered key chunks, tile by tile with torch's CPU flash kernel, the
    tiles merged by their log-sum-exp (online softmax): no [T/C, T] score or mask tensor, only tiles' masks
    where a document or window boundary crosses one. Backward runs the kernel's backward per tile with the
    *merged* output and log-sum-exp, which gives each tile's exact share of the gradient (the softmax of a tile
    is the merged one's restriction to its keys)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: List[_Block], scale: Optional[float]):
        c = q.size(2) // 2
        qs, ks, vs = q.split(c, 2), k.split(c, 2), v.split(c, 2)
        outs, lses = [], []
        for a in range(2):
            out = lse = None
            for block in (b for b in blocks if b.query == a):  # the diagonal tile first: every row's lse is finite
                o, l = _FLASH(qs[a], ks[block.key], vs[block.key], 0.0, block.causal, attn_mask=block.mask, scale=scale)
                if block.blind is not None:
                    l = l.masked_fill(block.blind, float("-inf"))
                if out is None:
                    out, lse = o.float(), l
                    continue
                merged = torch.logaddexp(lse, l)
                out = out * (lse - merged).exp().unsqueeze(-1) + o.float() * (l - merged).exp().unsqueeze(-1)
                lse = merged
            outs.append(out.to(q.dtype))
            lses.append(lse)
        out, lse = torch.cat(outs, 2), torch.cat(lses, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.scale = blocks, scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        c = q.size(2) // 2
        dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, v))
        qs, ks, vs, outs, grads = q.split(c, 2), k.split(c, 2), v.split(c, 2), out.split(c, 2), grad.split(c, 2)
        lses = lse.split(c, 2)
        for block in ctx.blocks:
            a, b = block.query, block.key
            gq, gk, gv = _FLASH_BACKWARD(
                grads[a].contiguous(),
                qs[a],
                ks[b],
                vs[b],
                outs[a],
                lses[a],
                0.0,
                block.causal,
                attn_mask=block.mask,
                scale=ctx.scale,
            )
            dq[:, :, a * c : (a + 1) * c] += gq
            dk[:, :, b * c : (b + 1) * c] += gk
            dv[:, :, b * c : (b + 1) * c] += gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


class ContextShard:
    """This rank's share of one micro-batch's sequences, passed by the model to each attention layer as its mask.

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
    ):
        self.cp_size, self.cp_rank, self.group = cp_size, cp_rank, group
        self.query_index = chunk_layout(seq_len, cp_size, cp_rank).to(device)
        self.key_index = gathered_layout(seq_len, cp_size).to(device)
        self.document_ids = document_ids
        self._masks: Dict[Optional[int], torch.Tensor] = {}
        self._blocks: Dict[Tuple[Optional[int], torch.dtype], List[_Block]] = {}

    def mask(self, window: Optional[int] = None) -> torch.Tensor:
        """bool [B or 1, 1, T/C, T]: this rank's queries over the gathered keys (built once per window)."""
        if window not in self._masks:
            self._masks[window] = visible_keys(self.query_index, self.key_index, self.document_ids, window)
        return self._masks[window]

    def blocks(self, window: Optional[int], dtype: torch.dtype) -> List[_Block]:
        """The visible tiles of :class:`_ChunkedAttention` (built once per window and dtype per micro-batch)."""
        if (window, dtype) in self._blocks:
            return self._blocks[(window, dtype)]
        c = self.query_index.numel() // 2
        queries, keys = self.query_index.view(2, c), self.key_index.view(-1, c)
        diagonal, others = [], []
        causal = torch.ones(c, c, dtype=torch.bool, device=queries.device).tril()
        for a in range(2):
            for b in range(keys.size(0)):
                visible = visible_keys(queries[a], keys[b], self.document_ids, window)
                if not visible.any():
                    continue
                is_diagonal = bool(queries[a, 0] == keys[b, 0])
                if visible.all():
                    block = _Block(a, b, False, None, None)
                elif is_diagonal and bool((visible == causal).all()):
                    block = _Block(a, b, True, None, None)
                else:
                    additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
                    blind = ~visible.any(-1)
                    block = _Block(
                        a, b, False, additive.masked_fill_(~visible, float("-inf")), blind if blind.any() else None
                    )
                (diagonal if is_diagonal else others).append(block)
        self._blocks[(window, dtype)] = diagonal + others
        return self._blocks[(window, dtype)]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., T/C, D] on each rank -> [..., T, D] in :func:`gathered_layout` order."""
        if self.cp_size == 1:
            return x
        return _GatherSequence.apply(x, self.group, self.cp_rank, self.cp_size)

    @torch.compiler.disable
    def attend_across_ranks(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: Optional[int] = None,
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
    ) -> torch.Tensor:
        """Attention of this rank's queries q [B, H, T/C, D] over the whole sequence's keys/values (k, v
        [B, G, T/C, D] here, gathered in one collective) -> [B, H, T/C, D]. On CPU tile by tile
        (:class:`_ChunkedAttention`); elsewhere, or with soft-capped logits (no kernel has the cap and the
        log-sum-exp), the toolkit's ``attend`` under the [T/C, T] mask.

        Eager under ``--compile`` (``torch.compiler.disable``): a compiled block is a graph before and one
        after this call (``toolkit.distributed.compile``). Traced, the collective would break the graph anyway,
        and the tiles (which exist, which are causal, which carry a mask) are Python decisions on each batch's
        document boundaries that a graph would guard on, recompiling batch after batch. Decorated at import
        (this module is imported only by context-parallel runs): one function object, so the compiled blocks'
        guards on it hold from one micro-batch's shard to the next."""
        kv = self.gather(torch.stack([k, v]))
        k, v = kv[0], kv[1]
        if softcap is None and q.device.type == "cpu":
            return _ChunkedAttention.apply(q, k, v, self.blocks(window, q.dtype), scale)
        return attend(q, k, v, self.mask(window), causal=False, scale=scale, softcap=softcap)


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
    shard = ContextShard(T, cp_size, cp_rank, group, net_input.get("document_ids"), tokens.device)
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


__all__ = ["ContextShard", "chunk_layout", "gathered_layout", "visible_keys", "shard_sample", "pad_to_chunks"]
