"""The attention variants: how a layer projects its input into queries, keys and values and its output back.

Shape notation: B batch, T positions, H query heads, G key/value heads (H % G == 0: grouped-query attention,
G = 1 multi-query, G = H multi-head), D head size, C model width.

- :class:`Attention`: separate ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (Hugging Face's names), with the
  options of the families: QK-norm (an RMSNorm over each head of q and k before the rotation: Qwen3, Gemma 3; or
  over the whole projection before the heads split: OLMo 2, OLMoE), the logit soft-cap (Gemma 2), the sliding
  window (Mistral, Gemma's local layers), a custom scale (Gemma), attention sinks (gpt-oss: a learned logit per
  head in the softmax's denominator, parameter ``sinks`` [H]), biases on q/k/v (Qwen2) and on the output (gpt-oss),
  no rotation at all (``rotary=False``: SmolLM3's NoPE layers, whose positions come from the causal mask alone);
- :class:`GatedAttention`: Qwen3-Next's, ``o_proj(attention * sigmoid(gate))``, the gate a second half of each
  query head's projection;
- :class:`FusedQKVAttention`: fairseq's (``transformer_lm``), q, k and v from one ``qkv_proj``, ``out_proj``,
  biases, attention dropout.

Each head count follows from the projections' output widths, so a tensor-parallel split of the projections by
heads runs this code unchanged on its share. Every variant here leaves (k, v) of its G heads per position
(``AttentionLayer.project``'s entries): the KV cache holds G heads, not H.

- :class:`LatentAttention`: DeepSeek-V2/V3's multi-head latent attention, whose positions leave a compressed
  latent and one rotary key shared by the heads instead of each head's keys and values.

A new variant is one class: what its positions leave (``project``'s entries) and how keys and values are
expanded from them (``keys_values``); the cache, the back ends and the context-parallel exchange take it as it is.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.models.common.norms import RMSNorm
from toolkit.models.common.rope import apply_rope, yarn_attention_factor
from toolkit.models.common.attention.across_ranks import ChunkedVisibility
from toolkit.models.common.attention.backends import SDPA, choose_backend
from toolkit.models.common.attention.layer import AttentionLayer, Entries
from toolkit.models.common.attention.qk_clip import scale_rows


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
        rotary: bool = True,
    ):
        super().__init__(window=window, scale=scale, softcap=softcap)
        self.head_dim = head_dim
        self.rotary = rotary  # False: q and k pass unrotated (a NoPE layer), whatever tables the model hands in
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
        """q [B, T, H*D] and k [B, T, G*D] -> [B, H, T, D], [B, G, T, D]: normalized (QK-norm), rotated (unless
        the layer has no rotation)."""
        if self.q_norm is not None and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        per_head = self.qk_norm_per_head
        q, k = self._heads(q, self.q_norm if per_head else None), self._heads(k, self.k_norm if per_head else None)
        if not self.rotary:
            return q, k
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tuple[torch.Tensor, Entries, Any]:
        """q [B, H, T, D]; entries k and v [B, G, T, D]: projected, normalized (QK-norm), q and k rotated."""
        q, k = self.rotated(self.q_proj(x), self.k_proj(x), cos, sin)
        return q, (k, self._heads(self.v_proj(x))), None

    def output(self, y: torch.Tensor, carry: Any) -> torch.Tensor:
        """[B, H, T, D] -> [B, T, C] through ``o_proj``."""
        return self.o_proj(y.transpose(1, 2).flatten(2))

    def clip_heads(self, gamma: torch.Tensor) -> None:
        """QK-clip (``qk_clip.py``): each head's logits scaled by its ``gamma`` [H], a key head by the square root
        of its group's smallest, each query head by the rest (a query head's rows: its query, then what else
        ``query_width`` gives it, left as it is)."""
        H, G = gamma.numel(), self.k_proj.out_features // self.head_dim
        key = gamma.view(G, H // G).amin(dim=1).sqrt()  # [G]
        query = gamma / key.repeat_interleave(H // G)  # [H]
        per_head = self.q_proj.out_features // H
        q_rows = torch.ones(H, per_head, device=gamma.device)
        q_rows[:, : self.head_dim] = query[:, None]
        k_rows = key.repeat_interleave(self.head_dim)
        for proj, rows in ((self.q_proj, q_rows.flatten()), (self.k_proj, k_rows)):
            scale_rows(proj.weight, rows)
            if proj.bias is not None:
                scale_rows(proj.bias, rows)


class GatedAttention(Attention):
    """Qwen3-Next's gated attention: ``q_proj`` yields each head's query and its gate side by side ([H, 2D], Hugging
    Face's layout), the output is ``o_proj(attention * sigmoid(gate))``: each head's output scaled per feature by
    the token itself. A split of ``q_proj`` by heads keeps each head's query and gate together."""

    @staticmethod
    def query_width(heads: int, head_dim: int) -> int:
        return 2 * heads * head_dim

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tuple[torch.Tensor, Entries, Any]:
        projected = self.q_proj(x)
        B, T, _ = projected.shape  # all positions under sequence parallelism (the column-parallel split gathers)
        q, gate = projected.view(B, T, -1, 2 * self.head_dim).chunk(2, dim=-1)
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

    def clip_heads(self, gamma: torch.Tensor) -> None:
        """QK-clip (``qk_clip.py``): head h's query and key rows of ``qkv_proj`` (and biases) times sqrt(gamma_h)."""
        root = gamma.sqrt().repeat_interleave(self.head_dim)
        rows = torch.cat([root, root, torch.ones_like(root)])
        scale_rows(self.qkv_proj.weight, rows)
        scale_rows(self.qkv_proj.bias, rows)

    def forward(self, x: torch.Tensor, kv_cache=None, attn_mask: Any = None) -> torch.Tensor:
        """x [B, T, C] -> [B, T, C]: causal (right padding needs no mask of its own), or under ``attn_mask``
        (documents); with ``kv_cache`` the new positions after the cached ones."""
        return super().forward(x, None, None, kv_cache, attn_mask)


class LatentAttention(AttentionLayer):
    """DeepSeek-V2/V3's multi-head latent attention (MLA); parameters by Hugging Face's names.

    Queries: ``q_proj`` [H (Dn + Dr), C], or through a low rank (``q_rank``: ``q_a_proj`` [q_rank, C], its RMSNorm
    ``q_a_layernorm``, ``q_b_proj`` [H (Dn + Dr), q_rank]); each head's first Dn features are not rotated, its last
    Dr are. Keys and values: ``kv_a_proj_with_mqa`` [r + Dr, C] compresses a position into a latent of r features
    (normalized by ``kv_a_layernorm``) and one rotary key part of Dr features shared by every head; ``kv_b_proj``
    [H (Dn + Dv), r] expands the latent into each head's unrotated key part and its value. A position's entries
    are the normalized latent [B, 1, T, r] and the rotated shared key [B, 1, T, Dr]: r + Dr numbers a token per
    layer where the expanded keys and values are H (Dn + Dr + Dv) (DeepSeek-V3: 576 against 40,960), which the KV
    cache and the context-parallel exchange carry; ``keys_values`` expands them for the forward over a sequence.
    Decoding attends over the cached entries as they are (:meth:`attend_cached`, DeepSeek's absorbed form): each
    head's query part meets the latent through ``kv_b_proj``'s key rows (q_nope W_uk, [B, H, T, r]), so the
    attention is multi-query over one key [latent | rotary key] per position, and its output, a mix of latents,
    leaves each head through the value rows (W_uv): no position's keys and values are ever expanded.

    Rotation: the rotary features are in the halves layout (``rope.apply_rope``); checkpoints whose rotary
    features are interleaved pairs (Hugging Face's ``rope_interleave``) are permuted on import. The two RMSNorms
    take epsilon 1e-6, as DeepSeek's. The softmax scale is :func:`latent_attention_scale`'s. A tensor-parallel split
    of ``q_proj``/``q_b_proj`` and ``kv_b_proj`` by heads runs this code on its share (the head count follows from
    their widths); the compressions are whole on every rank.
    """

    NORM_EPS = 1e-6

    def __init__(
        self,
        dim: int,
        heads: int,
        kv_rank: int,
        rope_dim: int,
        nope_dim: int,
        v_dim: int,
        q_rank: Optional[int] = None,
        scale: Optional[float] = None,
        window: Optional[int] = None,
    ):
        super().__init__(window=window, scale=(nope_dim + rope_dim) ** -0.5 if scale is None else scale)
        self.kv_rank, self.rope_dim, self.nope_dim, self.v_dim = kv_rank, rope_dim, nope_dim, v_dim
        qk_dim = nope_dim + rope_dim
        if q_rank is None:
            self.q_proj = nn.Linear(dim, heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(dim, q_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_rank, self.NORM_EPS)
            self.q_b_proj = nn.Linear(q_rank, heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, kv_rank + rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_rank, self.NORM_EPS)
        self.kv_b_proj = nn.Linear(kv_rank, heads * (nope_dim + v_dim), bias=False)
        self.o_proj = nn.Linear(heads * v_dim, dim, bias=False)

    def kv_width(self) -> int:
        return self.kv_rank + self.rope_dim

    def expanded_kv_width(self) -> int:
        """H (Dn + Dr + Dv): each head's key and value, what a cache of expanded keys and values would hold."""
        heads = self.kv_b_proj.out_features // (self.nope_dim + self.v_dim)
        return heads * (self.nope_dim + self.rope_dim + self.v_dim)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, C] -> [B, T, H (Dn + Dr)], through the low rank when there is one."""
        if "q_proj" in self._modules:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Tuple[torch.Tensor, Entries, Any]:
        """q [B, H, T, Dn + Dr] (its rotary part rotated); entries: the latent [B, 1, T, r] and the rotated
        shared key [B, 1, T, Dr]."""
        q = self.queries(x)  # [B, T, H D]: T from q (under sequence parallelism x holds T/M positions)
        q = q.view(*q.shape[:2], -1, self.nope_dim + self.rope_dim).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent).unsqueeze(1)
        return q, (latent, apply_rope(k_rope.unsqueeze(1), cos, sin)), None

    def keys_values(self, entries: Entries) -> Tuple[torch.Tensor, torch.Tensor]:
        """The latent [B, 1, S, r] and shared key [B, 1, S, Dr] of S positions -> k [B, H, S, Dn + Dr] (each head's
        expanded part, then the shared rotary part), v [B, H, S, Dv]."""
        latent, k_rope = entries
        B, _, S, _ = latent.shape
        kv = self.kv_b_proj(latent[:, 0]).view(B, S, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        return torch.cat([k_nope, k_rope.expand(-1, k_nope.size(1), -1, -1)], dim=-1), v

    def attend_cached(self, q: torch.Tensor, entries: Entries, mask: Any) -> torch.Tensor:
        """q [B, H, T, Dn + Dr] over the cached latents [B, 1, S, r] and rotary keys [B, 1, S, Dr] with
        ``kv_b_proj`` absorbed (see the class docstring) -> [B, H, T, Dv]; the logits are the expanded form's,
        the scale the same (not the width of the latent key)."""
        latent, k_rope = entries
        up = self.kv_b_proj.weight.view(-1, self.nope_dim + self.v_dim, self.kv_rank)  # [H, Dn + Dv, r]
        up_k, up_v = up.split([self.nope_dim, self.v_dim], dim=1)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, up_k)
        mixed = self.attend(torch.cat([q_latent, q_rope], dim=-1), torch.cat([latent, k_rope], dim=-1), latent, mask)
        return torch.einsum("bhtr,hvr->bhtv", mixed, up_v)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, export: bool = False):
        """The core call, on the CPU with values narrower than the queries (Dv < Dn + Dr) padded with zero features
        to the queries' width where SDPA takes the call: its fused CPU kernel (flash attention) wants one width for
        q, k and v, and without it SDPA falls back to its math form, which materializes, masks and softmaxes every
        [T, T] logit forward and backward. The zero features' outputs are zeros, cut off here."""
        narrower = q.size(-1) - v.size(-1)
        dropout = self.dropout if self.training else 0.0
        if (
            narrower > 0
            and q.device.type == "cpu"
            and not isinstance(mask, ChunkedVisibility)
            and choose_backend(mask, q, v, self.softcap, self.sinks, dropout, export) == SDPA
        ):
            return super().attend(q, k, F.pad(v, (0, narrower)), mask)[..., : v.size(-1)]
        return super().attend(q, k, v, mask, export)

    def output(self, y: torch.Tensor, carry: Any) -> torch.Tensor:
        """[B, H, T, Dv] -> [B, T, C] through ``o_proj``."""
        return self.o_proj(y.transpose(1, 2).flatten(2))

    def clip_heads(self, gamma: torch.Tensor) -> None:
        """QK-clip (``qk_clip.py``), Kimi K2's rule for latent attention: head h's unrotated query rows and its key
        rows of ``kv_b_proj`` times sqrt(gamma_h), its rotary query rows times gamma_h; the shared rotary key as
        it is."""
        root = gamma.sqrt()[:, None]
        q_rows = torch.cat([root.expand(-1, self.nope_dim), gamma[:, None].expand(-1, self.rope_dim)], dim=1)
        kv_rows = torch.cat([root.expand(-1, self.nope_dim), torch.ones_like(root).expand(-1, self.v_dim)], dim=1)
        queries = self.q_proj if "q_proj" in self._modules else self.q_b_proj
        scale_rows(queries.weight, q_rows.flatten())
        scale_rows(self.kv_b_proj.weight, kv_rows.flatten())


def latent_attention_scale(qk_dim: int, rope_scaling_factor: Optional[float] = None, mscale_all_dim: float = 0.0):
    """DeepSeek's softmax scale: 1/sqrt(Dn + Dr), times mscale^2 where YaRN stretches the context (``mscale`` =
    0.1 ``mscale_all_dim`` ln(factor) + 1: the logits of every feature, not only the rotated ones, sharpen as the
    tables' own attention factor does; DeepSeek-V3 has ``mscale_all_dim`` 1)."""
    scale = qk_dim**-0.5
    if rope_scaling_factor is not None and mscale_all_dim:
        scale *= yarn_attention_factor(rope_scaling_factor, mscale_all_dim) ** 2
    return scale
