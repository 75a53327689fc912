"""``transformer_lm``'s cached forward as one traceable module: what ``toolkit-export --format onnx --kv-cache``
writes as ``decoder_with_past.onnx`` (``TransformerLanguageModel.onnx_cached_decoder``).

Written here, from the family's own modules, so the graph does not depend on an incremental path inside
the model, and the exporter holds no block layout of any family.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn.functional as F


class CachedDecoder(torch.nn.Module):
    """The model's forward for new tokens after P cached positions; returns logits and the grown cache.

    Same arithmetic as ``TransformerLanguageModel.forward`` restricted to the new rows: keys and
    values of earlier positions come from the cache, the causal mask is offset by P
    (``AttentionLayer.forward_with_past``).
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    @property
    def cache_shape(self) -> Tuple[int, int]:
        """(heads, head size): the cache tensors' dimensions 1 and 3."""
        H = self.model.cfg.decoder_attention_heads
        return H, self.model.cfg.decoder_embed_dim // H

    def _embed(self, tokens: torch.Tensor, past_len: int) -> torch.Tensor:
        m = self.model
        x = m.embed_tokens(tokens)
        if m.embed_scale != 1.0:
            x = x * m.embed_scale
        positions = torch.arange(tokens.size(1), device=tokens.device) + past_len
        if m.embed_positions is not None:
            x = x + m.embed_positions.weight.index_select(0, positions + (m.padding_idx + 1))
        elif m.sinusoidal_positions is not None:
            x = x + m.sinusoidal_positions.index_select(0, positions)
        return x

    @staticmethod
    def _attention(attn, x: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor):
        """The layer's attention after P cached positions (the attention package's explicit form): (out, k, v)."""
        out, (k, v) = attn.forward_with_past(x, None, None, (past_k, past_v))
        return out, k, v

    def _block(self, layer, x, past_k, past_v):
        if layer.normalize_before:
            h, k, v = self._attention(layer.self_attn, layer.self_attn_layer_norm(x), past_k, past_v)
            x = x + h
            x = x + layer.ffn(layer.final_layer_norm(x))
        else:
            h, k, v = self._attention(layer.self_attn, x, past_k, past_v)
            x = layer.self_attn_layer_norm(x + h)
            x = layer.final_layer_norm(x + layer.ffn(x))
        return x, k, v

    def forward(self, tokens: torch.Tensor, *past: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        m = self.model
        x = self._embed(tokens, past[0].size(2))
        present: List[torch.Tensor] = []
        for i, layer in enumerate(m.layers):
            x, k, v = self._block(layer, x, past[2 * i], past[2 * i + 1])
            present += [k, v]
        if m.layer_norm is not None:
            x = m.layer_norm(x)
        logits = F.linear(x, m.embed_tokens.weight) if m.output_projection is None else m.output_projection(x)
        return (logits, *present)
