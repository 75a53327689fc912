"""Decoder blocks by where they normalize. The placement is the block's class; the attention, the MLP and the
norm are its arguments, so a family composes its block instead of switching inside one:

==================  =====================================================  ===============================
block               computes                                               families
==================  =====================================================  ===============================
``PreNormBlock``    x + attn(norm(x)), then x + mlp(norm(x))               Llama, Mistral, Qwen, MoE
``NormAfterBlock``  x + norm(attn(x)), then x + norm(mlp(x))               OLMo 2
``SandwichBlock``   x + norm(attn(norm(x))), then x + norm(mlp(norm(x)))   Gemma 2 / 3
==================  =====================================================  ===============================

Hugging Face's names: ``input_layernorm`` (the attention's input norm), ``post_attention_layernorm`` (a
pre-norm block's MLP input norm, the other blocks' attention output norm), ``pre_feedforward_layernorm``,
``post_feedforward_layernorm``; ``self_attn``, ``mlp``. The modules register in that order (the order of a
checkpoint's tensors and of an optimizer's parameters).

A block is a plain ``(x, cos, sin[, cache])`` function that FSDP2, activation checkpointing and
``torch.compile`` wrap from outside. ``attention_input`` and ``add_attention`` split it around the attention,
for a forward that runs the attention itself (the ONNX cached decoder).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from toolkit.models.common.attention.cache import KVCache

Norm = Callable[[], nn.Module]


class DecoderBlock(nn.Module):
    """What the three placements share: the forward around ``attention_input`` and ``add_attention``."""

    def attention_input(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def add_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual add of the attention's output, then the MLP's."""
        raise NotImplementedError

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: Optional[KVCache] = None,
        attn_mask: Any = None,
        context_parallel: Any = None,
    ) -> torch.Tensor:
        """``attn_mask``: the forward's mask for this layer's window; ``context_parallel``: the sequence shard
        (``toolkit.distributed.context_parallel.ContextShard``), whose ranks' keys the attention gathers."""
        h = self.attention_input(x)
        # The cache is passed only when there is one (the mask and the shard by keyword): styles hooked on
        # self_attn describe its positional inputs.
        if kv_cache is not None:
            return self.add_attention(x, self.self_attn(h, cos, sin, kv_cache))
        return self.add_attention(
            x, self.self_attn(h, cos, sin, attn_mask=attn_mask, context_parallel=context_parallel)
        )


class PreNormBlock(DecoderBlock):
    """x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, attention: nn.Module, mlp: nn.Module, norm: Norm):
        super().__init__()
        self.input_layernorm = norm()
        self.self_attn = attention
        self.post_attention_layernorm = norm()
        self.mlp = mlp

    def attention_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.input_layernorm(x)

    def add_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x))


class NormAfterBlock(DecoderBlock):
    """x + norm(attn(x)), then x + norm(mlp(x)): the sublayers read the residual stream as it is."""

    def __init__(self, attention: nn.Module, mlp: nn.Module, norm: Norm):
        super().__init__()
        self.self_attn = attention
        self.post_attention_layernorm = norm()
        self.mlp = mlp
        self.post_feedforward_layernorm = norm()

    def attention_input(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def add_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(x))


class SandwichBlock(DecoderBlock):
    """x + norm(attn(norm(x))), then x + norm(mlp(norm(x))): a norm before and after each sublayer."""

    def __init__(self, attention: nn.Module, mlp: nn.Module, norm: Norm):
        super().__init__()
        self.input_layernorm = norm()
        self.self_attn = attention
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = mlp
        self.post_feedforward_layernorm = norm()

    def attention_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.input_layernorm(x)

    def add_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
