"""Position-wise feed-forward blocks: gated (SwiGLU, GeGLU) and plain (GELU).

Parameter names are Hugging Face's (``gate_proj``, ``up_proj``, ``down_proj``), so a family's checkpoints
map onto them by renaming nothing inside the block. ``FEED_FORWARDS`` builds one by name; a
mixture-of-experts block takes its place by registering a constructor with the same signature
(``(dim, hidden, bias) -> module``, ``forward(x [B, T, C]) -> [B, T, C]``); its load-balancing loss
goes out through the model's extra output (``toolkit.models.outputs``), its router's bias update
through the trainer's post-step hooks (``toolkit.core.protocols.PostStepHook``).
"""

from __future__ import annotations

import functools
from typing import Callable, Dict

import torch
import torch.nn as nn
import torch.nn.functional as F

ACTIVATIONS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),  # Gemma's gelu_pytorch_tanh
}


class GatedFeedForward(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu (Llama, Qwen, OLMo), GeGLU with gelu_tanh (Gemma)."""

    def __init__(self, dim: int, hidden: int, activation: str = "silu", bias: bool = False):
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class FeedForward(nn.Module):
    """down(act(up(x))): the ungated two-layer MLP (GELU in GPT-2 style models)."""

    def __init__(self, dim: int, hidden: int, activation: str = "gelu", bias: bool = False):
        super().__init__()
        self.act = ACTIVATIONS[activation]
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


FEED_FORWARDS: Dict[str, Callable[..., nn.Module]] = {
    "swiglu": functools.partial(GatedFeedForward, activation="silu"),
    "geglu": functools.partial(GatedFeedForward, activation="gelu_tanh"),
    "gelu": functools.partial(FeedForward, activation="gelu"),
}
