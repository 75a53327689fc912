"""Context parallelism's attention arithmetic: this rank's queries over the keys gathered from every cp rank.

``toolkit.distributed.context_parallel`` lays each sequence out over the cp ranks and gathers the keys/values (the
communication); this module says which gathered key each query sees and computes the attention over them:

- :func:`visible_keys`: query at sequence index q sees key k when k <= q, q - k < window and both are in the same
  document (documents crossing chunk boundaries included: the masks compare the whole row's document ids);
- :class:`ChunkedVisibility`: that visibility for one rank's query indices over the gathered key indices, as a
  bool [B or 1, 1, T/C, T] mask (:meth:`~ChunkedVisibility.dense`) or as the tiles the CPU path goes through
  (:meth:`~ChunkedVisibility.tiles`);
- :func:`chunked_attention`: (query chunk, key chunk) pairs of c = T/2C positions, each through torch's CPU flash
  kernel (``is_causal`` on the diagonal tile, no mask on the earlier chunks, an additive mask only on tiles a document
  or window boundary crosses, hidden tiles skipped), merged by their log-sum-exp (online softmax), so no [T/C, T]
  score or mask tensor exists.

Which of the two runs is ``backends.choose_backend``'s decision.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional

import torch


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


class Tile(NamedTuple):
    """One (query chunk, key chunk) tile of a rank's attention: ``query`` 0 or 1 (the rank's first or second
    chunk), ``key`` the chunk's place among the gathered keys; ``causal``: the diagonal tile of a plain causal
    mask; ``mask``: the additive mask of a partly visible tile (None: all visible); ``blind``: [B or 1, 1, c] the
    rows that see no key of this tile (None: every row sees one)."""

    query: int
    key: int
    causal: bool
    mask: Optional[torch.Tensor]
    blind: Optional[torch.Tensor]


class ChunkedVisibility:
    """What one cp rank's queries (its two chunks, at sequence indices ``query_index``) see of the gathered keys (at
    ``key_index``), causal, within ``document_ids``' documents and the layer's ``window``."""

    def __init__(
        self,
        query_index: torch.Tensor,
        key_index: torch.Tensor,
        document_ids: Optional[torch.Tensor] = None,
        window: Optional[int] = None,
    ):
        self.query_index, self.key_index, self.document_ids, self.window = query_index, key_index, document_ids, window
        self._dense: Optional[torch.Tensor] = None
        self._tiles: Dict[torch.dtype, List[Tile]] = {}

    def dense(self) -> torch.Tensor:
        """bool [B or 1, 1, T/C, T] (built once)."""
        if self._dense is None:
            self._dense = visible_keys(self.query_index, self.key_index, self.document_ids, self.window)
        return self._dense

    def tiles(self, dtype: torch.dtype) -> List[Tile]:
        """The visible tiles of :func:`chunked_attention`, the diagonal ones first (built once per dtype)."""
        if dtype not in self._tiles:
            self._tiles[dtype] = self._plan(dtype)
        return self._tiles[dtype]

    def _plan(self, dtype: torch.dtype) -> List[Tile]:
        c = self.query_index.numel() // 2
        queries, keys = self.query_index.view(2, c), self.key_index.view(-1, c)
        diagonal, others = [], []
        causal = torch.ones(c, c, dtype=torch.bool, device=queries.device).tril()
        for a in range(2):
            for b in range(keys.size(0)):
                visible = visible_keys(queries[a], keys[b], self.document_ids, self.window)
                if not visible.any():
                    continue
                is_diagonal = bool(queries[a, 0] == keys[b, 0])
                if visible.all():
                    tile = Tile(a, b, False, None, None)
                elif is_diagonal and bool((visible == causal).all()):
                    tile = Tile(a, b, True, None, None)
                else:
                    additive = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
                    blind = ~visible.any(-1)
                    tile = Tile(
                        a, b, False, additive.masked_fill_(~visible, float("-inf")), blind if blind.any() else None
                    )
                (diagonal if is_diagonal else others).append(tile)
        return diagonal + others


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _TiledAttention(torch.autograd.Function):
    """A rank's two query chunks over the gathered key chunks, tile by tile with torch's CPU flash kernel, the tiles
    merged by their log-sum-exp. Backward runs the kernel's backward per tile with the *merged* output and
    log-sum-exp, which gives each tile's exact share of the gradient (the softmax of a tile is the merged one's
    restriction to its keys)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: List[Tile], scale: Optional[float]):
        c = q.size(2) // 2
        qs, ks, vs = q.split(c, 2), k.split(c, 2), v.split(c, 2)
        outs, lses = [], []
        for a in range(2):
            out = lse = None
            for tile in (t for t in tiles if t.query == a):  # the diagonal tile first: every row's lse is finite
                o, l = _FLASH(qs[a], ks[tile.key], vs[tile.key], 0.0, tile.causal, attn_mask=tile.mask, scale=scale)
                if tile.blind is not None:
                    l = l.masked_fill(tile.blind, float("-inf"))
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
        ctx.tiles, ctx.scale = tiles, scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        c = q.size(2) // 2
        dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, v))
        qs, ks, vs, outs, grads = q.split(c, 2), k.split(c, 2), v.split(c, 2), out.split(c, 2), grad.split(c, 2)
        lses = lse.split(c, 2)
        for tile in ctx.tiles:
            a, b = tile.query, tile.key
            gq, gk, gv = _FLASH_BACKWARD(
                grads[a].contiguous(),
                qs[a],
                ks[b],
                vs[b],
                outs[a],
                lses[a],
                0.0,
                tile.causal,
                attn_mask=tile.mask,
                scale=ctx.scale,
            )
            dq[:, :, a * c : (a + 1) * c] += gq
            dk[:, :, b * c : (b + 1) * c] += gk
            dv[:, :, b * c : (b + 1) * c] += gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def chunked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visibility: ChunkedVisibility, scale: Optional[float] = None
) -> torch.Tensor:
    """q [B, H, T/C, D] (the rank's two chunks) over the gathered k, v [B, G, T, D] tile by tile -> [B, H, T/C, D]."""
    return _TiledAttention.apply(q, k, v, visibility.tiles(q.dtype), scale)
