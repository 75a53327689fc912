"""The core call of every attention, :func:`attend`, and the one function that picks its kernel, :func:`choose_backend`.

Shape notation: B batch, H query heads, G key/value heads (H % G == 0: grouped-query attention, G = 1 multi-query),
Tq queries, Tk keys, D the head size of q and k, Dv the values'.

The logits' options, each off by default:

- ``scale``: the logits' multiplier (default 1/sqrt(D); Gemma's ``query_pre_attn_scalar ** -0.5``);
- ``softcap``: logits squashed to (-softcap, softcap) by ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2);
- ``sinks`` [H]: one learned logit per head that joins each row's softmax with no value behind it, so a row may give
  part of its weight to nothing (gpt-oss): ``p_j = exp(s_j) / (sum_i exp(s_i) + exp(sink))``;
- ``dropout``: on the probabilities (training only; fairseq's ``--attention-dropout``).

The back ends:

- SDPA (``scaled_dot_product_attention``): ``is_causal`` for the plain causal case, a bool mask otherwise,
  ``enable_gqa`` for fewer key/value heads (no copy of them);
- flex_attention: under a ``BlockMask`` (documents, windows; CUDA), the soft-cap as its ``score_mod``, the sinks
  through its log-sum-exp (``out * sigmoid(lse - sink)``: the row's weight left after the sink takes its share);
- explicit softmax(q k^T) v, the softmax in fp32 (Hugging Face's eager attention): the reference of the others,
  soft-capped logits and sinks without flex_attention, and what ONNX export traces (no SDPA ``enable_gqa`` or flex
  form there: the key/value heads are repeated);
- tiles (context parallelism on CPU, ``across_ranks``): this rank's queries over the gathered keys tile by tile.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from toolkit.models.common.attention.across_ranks import ChunkedVisibility, chunked_attention
from toolkit.models.common.attention.masks import EVERY_KEY, FLEX_MIN_HEAD_DIM, causal_mask, dense_mask, is_block_mask

SDPA, FLEX, EXPLICIT, TILES = "sdpa", "flex_attention", "explicit", "tiles"


def choose_backend(
    mask: Any,
    q: torch.Tensor,
    v: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    dropout: float = 0.0,
    export: bool = False,
) -> str:
    """The kernel of one call, from what it needs: export traces the explicit form; context parallelism's visibility
    goes tile by tile on CPU unless the logits are capped or sunk or dropped out (no kernel gives the cap or the sink
    with the log-sum-exp the tiles merge by) or the values are not as wide as the queries (the CPU flash kernel's
    rule); a ``BlockMask`` runs flex_attention where its kernel takes the heads; soft-capped logits and sinks need the
    explicit form without it (SDPA has neither); the rest is SDPA."""
    plain = softcap is None and sinks is None and dropout == 0.0
    same_width = v is None or v.size(-1) == q.size(-1)
    if export:
        return EXPLICIT
    if isinstance(mask, ChunkedVisibility) and plain and same_width and q.device.type == "cpu":
        return TILES
    if is_block_mask(mask) and q.size(-1) >= FLEX_MIN_HEAD_DIM and dropout == 0.0:
        return FLEX
    if softcap is not None or sinks is not None:
        return EXPLICIT
    return SDPA


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Any = None,
    *,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    dropout: float = 0.0,
    export: bool = False,
) -> torch.Tensor:
    """Attention of q [B, H, Tq, D] over k [B, G, Tk, D], v [B, G, Tk, Dv] -> [B, H, Tq, Dv] under ``mask`` (the
    forms of ``masks``), through the kernel :func:`choose_backend` picks."""
    backend = choose_backend(mask, q, v, softcap, sinks, dropout, export)
    if backend == TILES:
        return chunked_attention(q, k, v, mask, scale)
    if isinstance(mask, ChunkedVisibility):
        mask = mask.dense()
    if backend == FLEX:
        return flex(q, k, v, mask, scale, softcap, sinks)
    if is_block_mask(mask):
        mask = dense_mask(mask, q)
    if backend == SDPA:
        return sdpa(q, k, v, mask, scale, dropout)
    return explicit_attention(q, k, v, mask, scale, softcap, sinks, dropout)


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, scale: Optional[float], dropout: float = 0.0
) -> torch.Tensor:
    gqa = q.size(1) != k.size(1)
    if mask is None and q.size(2) == k.size(2):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=gqa, scale=scale)
    if mask is None:  # is_causal aligns the queries with the first keys: the last ones are meant
        mask = causal_mask(k.size(2) - q.size(2), q.size(2), device=q.device)
    attn_mask = None if mask is EVERY_KEY else mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout, enable_gqa=gqa, scale=scale)


def flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block: Any,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    kernel: Any = None,
) -> torch.Tensor:
    """flex_attention under ``block`` (``kernel``: the compiled one unless given, e.g. eager flex_attention)."""
    kernel = kernel or compiled_flex()
    score_mod = None
    if softcap is not None:

        def score_mod(score, b, h, q_idx, k_idx):
            return softcap * torch.tanh(score / softcap)

    gqa = q.size(1) != k.size(1)
    if sinks is None:
        return kernel(q, k, v, score_mod=score_mod, block_mask=block, scale=scale, enable_gqa=gqa)
    from torch.nn.attention.flex_attention import AuxRequest

    out, aux = kernel(
        q, k, v, score_mod=score_mod, block_mask=block, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True)
    )
    return with_sinks(out, aux.lse, sinks)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """An attention output [B, H, Tq, Dv] of rows with log-sum-exp ``lse`` [B, H, Tq], re-weighted as if each head's
    sink logit had joined the softmax: Z / (Z + exp(sink)) = sigmoid(lse - sink)."""
    weight = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
    return (out.float() * weight.unsqueeze(-1)).to(out.dtype)


_COMPILED: list = []


def compiled_flex():
    """flex_attention compiled once (eager flex materializes the whole score matrix)."""
    if not _COMPILED:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED.append(torch.compile(flex_attention, dynamic=False))
    return _COMPILED[0]


def explicit_attention(q, k, v, mask=None, scale=None, softcap=None, sinks=None, dropout=0.0) -> torch.Tensor:
    """softmax(cap(q k^T * scale) masked [, sinks]) v, the softmax in fp32 (Hugging Face's eager attention; gpt-oss's
    sink column joins the softmax and is dropped after it); the arguments are :func:`attend`'s."""
    if q.size(1) != k.size(1):
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is None:
        mask = causal_mask(k.size(2) - q.size(2), q.size(2), device=q.device)
    if mask is not EVERY_KEY:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = F.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(scores.size(0), -1, scores.size(2), 1)
        probs = F.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    probs = probs.to(q.dtype)
    if dropout > 0.0:
        probs = F.dropout(probs, dropout, training=True)
    return torch.matmul(probs, v)
