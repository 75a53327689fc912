"""The Llama forward over new tokens after P cached positions, with the cache as plain tensors in and out.

Why a second spelling of the forward: ``LlamaLanguageModel.forward``'s incremental decoding keeps its
cache in ``KVCache`` objects that grow in place, which an exported graph cannot hold. This module takes
the cache as inputs and returns the grown cache as outputs, the form ``toolkit-export --format onnx
--kv-cache`` writes (``decoder_with_past.onnx``: ``past_key_{i}``/``past_value_{i}`` [B, G, P, D] in,
``present_*`` [B, G, P + T, D] out, G the key/value heads). It runs the model's own modules (norms,
projections and norms, rotary tables, SwiGLU), so it cannot drift from the model's weights or settings; the
attention runs in the attention package's explicit form (``AttentionLayer.forward_with_past``: the key/value
heads repeated for the H query heads, as ``enable_gqa`` has no ONNX form).
"""

from __future__ import annotations

from typing import List, Tuple

import torch

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

    def forward(self, tokens: torch.Tensor, *past: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        m = self.model
        positions = torch.arange(tokens.size(1), device=tokens.device) + past[0].size(2)
        x = m.embed(tokens)
        present: List[torch.Tensor] = []
        for i, layer in enumerate(m.layers):
            cos_table, sin_table = m.rope_table(layer.self_attn.window)
            cos, sin = cos_table.index_select(0, positions), sin_table.index_select(0, positions)
            h, (k, v) = layer.self_attn.forward_with_past(layer.attention_input(x), cos, sin, past[2 * i : 2 * i + 2])
            x = layer.add_attention(x, h)
            present += [k, v]
        return (m.output(x), *present)
