"""Causal self-attention of the decoder families, and ``attend``: the one function that picks its kernel.

Shape notation: B batch, T new positions, P cached positions, H query heads, G key/value heads
(H % G == 0: grouped-query attention, G = 1 multi-query), D head size, C model width.

Options (each off by default, so Llama's attention is the plain case):

- ``qk_norm_eps``: RMSNorm over each head of q and k before the rotation (Qwen3, Gemma 3, OLMo 2's
  per-head form), parameters ``q_norm`` / ``k_norm`` [D];
- ``window``: sliding-window attention, position t sees s only when t - window < s <= t (Mistral,
  Gemma's local layers: Hugging Face's ``sliding_window``);
- ``softcap``: attention logits squashed to (-softcap, softcap) by ``softcap * tanh(s / softcap)``
  before the softmax (Gemma 2);
- ``scale``: the logits' multiplier (default 1/sqrt(D); Gemma's ``query_pre_attn_scalar ** -0.5``).

Back ends (``attend``): SDPA whenever the logits need no soft-capping (``is_causal`` for the plain
causal case, a boolean mask otherwise); ``flex_attention`` for a flex ``BlockMask`` (document masks and
windows on CUDA, ``attention_mask``), with the soft-cap as its ``score_mod``; the explicit
softmax(q k^T) v for soft-capping without a BlockMask (SDPA has no soft-cap).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.models import document_mask
from toolkit.models.blocks.norms import RMSNorm
from toolkit.models.blocks.rope import apply_rope


def causal_mask(past: int, new: int, window: Optional[int] = None, device=None) -> torch.Tensor:
    """bool [new, past + new]: the new positions past..past+new-1 see keys up to themselves (and within
    ``window``). Written with ``arange`` comparisons so that an exported graph keeps ``past`` symbolic."""
    query_pos = torch.arange(new, device=device) + past
    key_pos = torch.arange(past + new, device=device)
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask = mask & (query_pos[:, None] - key_pos[None, :] < window)
    return mask


def attention_mask(
    document_ids: Optional[torch.Tensor],
    seq_len: int,
    device=None,
    window: Optional[int] = None,
    head_dim: Optional[int] = None,
) -> Any:
    """What the layers of one forward attend with (built once per forward, per distinct window):
    None (plain causal), a bool mask [B or 1, 1, T, T], or a flex ``BlockMask`` on CUDA."""
    if window is None:
        return document_mask.make_attention_mask(document_ids, head_dim=head_dim)
    on_cuda = torch.device(device).type == "cuda" if device is not None else False
    if on_cuda and document_mask._flex() is not None and (head_dim or 0) >= document_mask.FLEX_MIN_HEAD_DIM:
        return _window_block_mask(document_ids, seq_len, window, device)
    mask = causal_mask(0, seq_len, window, device)[None]
    if document_ids is not None:
        mask = mask & (document_ids[:, :, None] == document_ids[:, None, :])
    return mask[:, None]


def _window_block_mask(document_ids: Optional[torch.Tensor], T: int, window: int, device):
    create_block_mask, _ = document_mask._flex()
    B = 1 if document_ids is None else document_ids.size(0)

    def visible(b, h, q, k):
        seen = (k <= q) & (q - k < window)
        return seen if document_ids is None else seen & (document_ids[b, q] == document_ids[b, k])

    return create_block_mask(visible, B, None, T, T, device=device)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Any = None,
    causal: bool = True,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Attention of q [B, H, Tq, D] over k, v [B, G, Tk, D] -> [B, H, Tq, D], with the mask of
    ``attention_mask`` / ``causal_mask``; ``mask=None`` is causal, or (``causal=False``) every key."""
    gqa = q.size(1) != k.size(1)
    if softcap is None:
        if mask is None and not causal:
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
        return document_mask.attend(q, k, v, mask, enable_gqa=gqa, scale=scale)
    if mask is not None and not isinstance(mask, torch.Tensor):  # a flex BlockMask
        if q.size(-1) >= document_mask.FLEX_MIN_HEAD_DIM:

            def capped(score, b, h, q_idx, k_idx):
                return softcap * torch.tanh(score / softcap)

            return document_mask._compiled_flex()(
                q, k, v, score_mod=capped, block_mask=mask, scale=scale, enable_gqa=gqa
            )
        mask = document_mask._dense_mask(mask, q)
    if mask is None and causal:
        mask = causal_mask(k.size(2) - q.size(2), q.size(2), device=q.device)
    return explicit_attention(q, k, v, mask, scale, softcap)


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """softmax(cap(q k^T * scale) masked) v, the softmax in fp32 (Hugging Face's eager attention):
    the reference for the kernels, and the back end for soft-capped logits without flex_attention."""
    if q.size(1) != k.size(1):
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class Attention(nn.Module):
    """Causal self-attention with H query heads sharing G key/value heads; parameters ``q_proj``,
    ``k_proj``, ``v_proj``, ``o_proj`` (and ``q_norm``, ``k_norm`` with QK-norm), Hugging Face's names.

    The head counts follow from the projections' output widths, so a tensor-parallel split of q/k/v by
    heads runs this code unchanged on its share. With a ``KVCache`` the cache holds G heads, not H.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        qk_norm_eps: Optional[float] = None,
        window: Optional[int] = None,
        softcap: Optional[float] = None,
        scale: Optional[float] = None,
        qk_norm_per_head: bool = True,
    ):
        super().__init__()
        self.head_dim, self.window, self.softcap, self.scale = head_dim, window, softcap, scale
        self.qk_norm_per_head = qk_norm_per_head  # else over the whole projection (OLMo 2), before the heads split
        self.q_proj = nn.Linear(dim, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim if qk_norm_per_head else heads * head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim if qk_norm_per_head else kv_heads * head_dim, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def kv_width(self) -> int:
        """Features of one token's keys plus values: what context parallelism exchanges per token (the planner)."""
        return self.k_proj.out_features + self.v_proj.out_features

    def _heads(self, x: torch.Tensor, norm: Optional[nn.Module] = None) -> torch.Tensor:
        B, T, width = x.shape
        x = x.view(B, T, width // self.head_dim, self.head_dim)
        if norm is not None:
            x = norm(x)
        return x.transpose(1, 2)  # [B, heads, T, D]

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, H, T, D], k and v [B, G, T, D]: projected, normalized per head (QK-norm), q and k rotated."""
        q, k = self.q_proj(x), self.k_proj(x)
        if self.q_norm is not None and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        per_head = self.qk_norm_per_head
        q = apply_rope(self._heads(q, self.q_norm if per_head else None), cos, sin)
        k = apply_rope(self._heads(k, self.k_norm if per_head else None), cos, sin)
        return q, k, self._heads(self.v_proj(x))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None, causal: bool = True
    ) -> torch.Tensor:
        """This layer's options (scale, soft-cap) on ``attend``; [B, H, Tq, D] -> [B, Tq, C] through ``o_proj``."""
        y = attend(q, k, v, mask, causal=causal, scale=self.scale, softcap=self.softcap)
        return self.o_proj(y.transpose(1, 2).flatten(2))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache=None, attn_mask: Any = None
    ) -> torch.Tensor:
        """x [B, T, C] -> [B, T, C]. ``attn_mask``: ``attention_mask``'s, built once per forward by the model
        (a sliding window without one is masked here), or a context-parallel shard that gathers the keys/values
        (``toolkit.distributed.context_parallel.ContextShard``); with ``kv_cache`` the new positions P..P+T-1 see
        every cached one (within the window) and the new ones up to themselves."""
        q, k, v = self.project(x, cos, sin)
        across_ranks = getattr(attn_mask, "attend_across_ranks", None)
        if across_ranks is not None:  # context parallelism: this chunk's queries, the whole sequence's keys
            y = across_ranks(q, k, v, self.window, self.scale, self.softcap)
            return self.o_proj(y.transpose(1, 2).flatten(2))
        if kv_cache is None:
            if attn_mask is None and self.window is not None:
                attn_mask = causal_mask(0, x.size(1), self.window, x.device)
            return self.attend(q, k, v, attn_mask)
        P, T = kv_cache.length, x.size(1)  # P: the cached positions (the last window - 1 in a local layer)
        k, v = kv_cache.append(k, v)
        needs_mask = T > 1 or (self.window is not None and P + T > self.window)
        y = self.attend(q, k, v, causal_mask(P, T, self.window, x.device) if needs_mask else None, causal=False)
        if self.window is not None:
            kv_cache.keep_last(self.window - 1)  # the next position reads these and itself
        return y
