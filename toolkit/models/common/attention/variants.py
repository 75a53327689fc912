"""The attention variants: how a layer projects its input into queries, keys and values and its output back.

Shape notation: B batch, T positions, H query heads, G key/value heads (H % G == 0: grouped-query attention,
G = 1 multi-query, G = H multi-head), D head size, C model width.

- :class:`Attention`: separate ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (Hugging Face's names), with the
  options of the families: QK-norm (an RMSNorm over each head of q and k before the rotation: Qwen3, Gemma 3; or
  over the whole projection before the heads split: OLMo 2, OLMoE), the logit soft-cap (Gemma 2), the sliding
  window (Mistral, Gemma's local layers), a custom scale (Gemma), attention sinks (gpt-oss: a learned logit per
  head in the softmax's denominator, parameter ``sinks`` [H]), biases on q/k/v (Qwen2) and on the output (gpt-oss);
- :class:`GatedAttention`: Qwen3-Next's, ``o_proj(attention * sigmoid(gate))``, the gate a second half of each
  query head's projection;
- :class:`FusedQKVAttention`: fairseq's (``transformer_lm``), q, k and v from one ``qkv_proj``, ``out_proj``,
  biases, attention dropout.

Each head count follows from the projections' output widths, so a tensor-parallel split of the projections by
heads runs this code unchanged on its share. Every variant here leaves (k, v) of its G heads per position
(``AttentionLayer.project``'s entries): the KV cache holds G heads, not H.

A new variant is one class: multi-head latent attention (DeepSeek-V3) would project q in two parts (a part
without rotation and a decoupled rotary part), leave the compressed kv and the shared rotary key per position
as its entries ([B, 1, T, r] and [B, 1, T, Dr]: the cache and the context-parallel exchange carry those), and
expand them into each head's keys and values in ``keys_values`` (the rotary key repeated over the heads).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn as nn

from toolkit.models.common.norms import RMSNorm
from toolkit.models.common.rope import apply_rope
from toolkit.models.common.attention.layer import AttentionLayer, Entries


class Attention(AttentionLayer):
    """Self-attention with H query heads sharing G key/value heads; parameters ``q_proj``, ``k_proj``, ``v_proj``,
    ``o_proj`` (and ``q_norm``, ``k_norm`` with QK-norm, ``sinks`` with sinks)."""

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
        qk_norm_unit_offset: bool = False,
        sinks: bool = False,
        output_bias: bool = False,
    ):
        super().__init__(window=window, scale=scale, softcap=softcap)
        self.head_dim = head_dim
        self.qk_norm_per_head = qk_norm_per_head  # else over the whole projection (OLMo 2), before the heads split
        self.q_proj = nn.Linear(dim, self.query_width(heads, head_dim), bias=qkv_bias)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=output_bias)
        if qk_norm_eps is not None:
            q_width, k_width = (head_dim, head_dim) if qk_norm_per_head else (heads * head_dim, kv_heads * head_dim)
            self.q_norm = RMSNorm(q_width, qk_norm_eps, unit_offset=qk_norm_unit_offset)
            self.k_norm = RMSNorm(k_width, qk_norm_eps, unit_offset=qk_norm_unit_offset)
        else:
            self.q_norm = self.k_norm = None
        if sinks:
            self.sinks = nn.Parameter(torch.empty(heads))

    @staticmethod
    def query_width(heads: int, head_dim: int) -> int:
        return heads * head_dim

    def kv_width(self) -> int:
        """Features of one token's keys plus values: what context parallelism exchanges per token (the planner)."""
        return self.k_proj.out_features + self.v_proj.out_features

    def _heads(self, x: torch.Tensor, norm: Optional[nn.Module] = None) -> torch.Tensor:
        B, T, width = x.shape
        x = x.view(B, T, width // self.head_dim, self.head_dim)
        if norm is not None:
            x = norm(x)
        return x.transpose(1, 2)  # [B, heads, T, D]

    def rotated(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """q [B, T, H*D] and k [B, T, G*D] -> [B, H, T, D], [B, G, T, D]: normalized (QK-norm), rotated."""
        if self.q_norm is not None and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        per_head = self.qk_norm_per_head
        q = apply_rope(self._heads(q, self.q_norm if per_head else None), cos, sin)
        k = apply_rope(self._heads(k, self.k_norm if per_head else None), cos, sin)
        return q, k

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tuple[torch.Tensor, Entries, Any]:
        """q [B, H, T, D]; entries k and v [B, G, T, D]: projected, normalized (QK-norm), q and k rotated."""
        q, k = self.rotated(self.q_proj(x), self.k_proj(x), cos, sin)
        return q, (k, self._heads(self.v_proj(x))), None

    def output(self, y: torch.Tensor, carry: Any) -> torch.Tensor:
        """[B, H, T, D] -> [B, T, C] through ``o_proj``."""
        return self.o_proj(y.transpose(1, 2).flatten(2))


class GatedAttention(Attention):
    """Qwen3-Next's gated attention: ``q_proj`` yields each head's query and its gate side by side ([H, 2D], Hugging
    Face's layout), the output is ``o_proj(attention * sigmoid(gate))``: each head's output scaled per feature by
    the token itself. A split of ``q_proj`` by heads keeps each head's query and gate together."""

    @staticmethod
    def query_width(heads: int, head_dim: int) -> int:
        return 2 * heads * head_dim

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tuple[torch.Tensor, Entries, Any]:
        B, T, _ = x.shape
        q, gate = self.q_proj(x).view(B, T, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q, k = self.rotated(q.reshape(B, T, -1), self.k_proj(x), cos, sin)
        return q, (k, self._heads(self.v_proj(x))), gate.reshape(B, T, -1)

    def output(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.o_proj(y.transpose(1, 2).flatten(2) * torch.sigmoid(gate))


class FusedQKVAttention(AttentionLayer):
    """fairseq's decoder self-attention: q, k and v from one ``qkv_proj`` (rows [q | k | v]), ``out_proj``, both with
    biases; H heads of D = C / H; the logits scaled by 1/sqrt(D); attention dropout in training. No rotation: the
    positions are added to the embeddings."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__(dropout=dropout)
        self.num_heads = heads
        self.head_dim = dim // heads
        self.qkv_proj = nn.Linear(dim, 3 * dim)  # q, k and v in one matmul: rows [q | k | v]
        self.out_proj = nn.Linear(dim, dim)

    def kv_width(self) -> int:
        return 2 * (self.qkv_proj.out_features // 3)

    def project(self, x: torch.Tensor, cos: Any = None, sin: Any = None) -> Tuple[torch.Tensor, Entries, Any]:
        """[B, T, 3C] -> q, k, v [B, H, T, D], views only (SDPA takes strided inputs). In backward SDPA's gradients
        come back in [B, T, H, D] memory order, so the views undo for free and split's backward is one concatenation
        into qkv's gradient (view/permute/unbind needed a stack plus a strided copy: benchmarks/attention_layout.py).
        Sizes as a list: ONNX opset 17 has no Split by number of outputs. The head count follows from the width:
        under tensor parallelism qkv_proj gives this rank's H/M heads ([B, T, 3C/M])."""
        B, T, _ = x.shape
        qkv = self.qkv_proj(x)
        width = qkv.size(-1) // 3
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in qkv.split([width] * 3, dim=-1))
        return q, (k, v), None

    def output(self, y: torch.Tensor, carry: Any) -> torch.Tensor:
        return self.out_proj(y.transpose(1, 2).flatten(2))  # [B, H, T, D] -> [B, T, H*D] -> [B, T, C]

    def forward(self, x: torch.Tensor, kv_cache=None, attn_mask: Any = None) -> torch.Tensor:
        """x [B, T, C] -> [B, T, C]: causal (right padding needs no mask of its own), or under ``attn_mask``
        (documents); with ``kv_cache`` the new positions after the cached ones."""
        return super().forward(x, None, None, kv_cache, attn_mask)
