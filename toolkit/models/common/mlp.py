"""Position-wise feed-forward blocks, gated (SwiGLU, GeGLU) and plain, and the one table of activations.

``ACTIVATIONS`` names every activation a model of the toolkit computes: fairseq's ``--activation-fn`` names
(``transformer_lm``, ``toolkit.utils.get_activation_fn``), the gated MLP's ``--mlp-activation`` and the MoE
experts' take theirs from it, so ``gelu_tanh`` is one function wherever it is named.

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

gelu_tanh = functools.partial(F.gelu, approximate="tanh")


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).pow(2)


ACTIVATIONS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact (erf) GELU, as fairseq's "gelu"
    "gelu_accurate": gelu_tanh,  # fairseq's name for the tanh approximation
    "gelu_fast": gelu_tanh,  # fairseq's deprecated alias of gelu_accurate
    "gelu_tanh": gelu_tanh,  # Hugging Face's gelu_pytorch_tanh (Gemma)
    "tanh": torch.tanh,
    "swish": F.silu,  # fairseq's name
    "silu": F.silu,
    "linear": identity,
    "relu_squared": relu_squared,
}


def activation(name: str, flag: str = "--activation-fn") -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation called ``name``; an unknown name raises naming ``flag`` and the known ones."""
    if name not in ACTIVATIONS:
        raise RuntimeError(f"{flag} {name} not supported; choose from {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


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
