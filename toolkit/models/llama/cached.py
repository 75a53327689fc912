"""The Llama forward over new tokens after P cached positions, with the cache as plain tensors in and out.

Why a second spelling of the forward: ``LlamaLanguageModel.forward``'s incremental decoding keeps its
cache in ``KVCache`` objects that grow in place, which an exported graph cannot hold. This module takes
the cache as inputs and returns the grown cache as outputs, the form ``toolkit-export --format onnx
--kv-cache`` writes (``decoder_with_past.onnx``: ``past_key_{i}``/``past_value_{i}`` [B, G, P, D] in,
``present_*`` [B, G, P + T, D] out, G the key/value heads). It runs the model's own modules (norms,
projections and norms, rotary tables, SwiGLU), so it cannot drift from the model's weights or settings; the
key/value heads are repeated for the H query heads explicitly (``enable_gqa`` has no ONNX form).
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn.functional as F

from toolkit.models.blocks.attention import causal_mask, explicit_attention
from toolkit.models.llama.config import head_dim, kv_heads


class LlamaCachedDecoder(torch.nn.Module):
    """``(tokens [B, T], *past) -> (logits [B, T, V], *present)``; P = 0 (empty past) is the prompt pass."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    @property
    def cache_shape(self) -> Tuple[int, int]:
        """(key/value heads, head size): the cache tensors' dimensions 1 and 3."""
        return kv_heads(self.model.cfg), head_dim(self.model.cfg)

    def _attention(
        self, attn, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor
    ):
        q, new_k, new_v = attn.project(h, cos, sin)
        k, v = torch.cat([past_k, new_k], dim=2), torch.cat([past_v, new_v], dim=2)
        mask = causal_mask(past_k.size(2), h.size(1), attn.window, h.device)  # [T, P + T]
        if attn.softcap is not None:  # SDPA has no soft-cap (explicit_attention repeats the heads itself)
            y = explicit_attention(q, k, v, mask, attn.scale, attn.softcap)
        else:
            repeat = q.size(1) // k.size(1)
            y = F.scaled_dot_product_attention(
                q,
                k.repeat_interleave(repeat, dim=1),
                v.repeat_interleave(repeat, dim=1),
                attn_mask=mask,
                scale=attn.scale,
            )
        return attn.o_proj(y.transpose(1, 2).flatten(2)), k, v

    def forward(self, tokens: torch.Tensor, *past: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        m = self.model
        positions = torch.arange(tokens.size(1), device=tokens.device) + past[0].size(2)
        x = m.embed(tokens)
        present: List[torch.Tensor] = []
        for i, layer in enumerate(m.layers):
            window = layer.self_attn.window
            local = window is not None and m.cfg.rope_local_theta is not None
            cos_table, sin_table = (m.rope_local_cos, m.rope_local_sin) if local else (m.rope_cos, m.rope_sin)
            cos, sin = cos_table.index_select(0, positions), sin_table.index_select(0, positions)
            h, k, v = self._attention(layer.self_attn, layer.attention_input(x), cos, sin, past[2 * i], past[2 * i + 1])
            x = layer.add_attention(x, h)
            present += [k, v]
        return (m.output(x), *present)
