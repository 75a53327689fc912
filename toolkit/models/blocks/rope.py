"""Rotary position embeddings: frequencies (optionally rescaled for a longer context), the cos/sin tables,
and the rotation, in Hugging Face's layout (the two halves of each head rotated together, not interleaved
pairs), the layout its checkpoints are stored in. Tables and rotation are fp32 (bf16 angles lose positions
beyond a few hundred).

A context-extension scheme is one function in ``SCALINGS``: ``(inverse frequencies, RopeScaling, base) ->
(rescaled inverse frequencies, attention factor)``; the factor multiplies cos and sin (YaRN's
``mscale``; 1.0 for Llama 3's scaling, which then leaves the tables untouched). Both compute what
transformers' ``_compute_llama3_parameters`` / ``_compute_yarn_parameters`` do, so imported checkpoints
keep their logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch


@dataclass(frozen=True)
class RopeScaling:
    """A frequency rescaling (``rope_scaling`` in a Hugging Face config). ``kind`` names a ``SCALINGS`` entry."""

    factor: float
    kind: str = "llama3"
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    beta_fast: float = 32.0  # YaRN: dimensions turning more than this often over the original context extrapolate
    beta_slow: float = 1.0  # YaRN: those turning less than this often interpolate (divided by the factor)
    attention_factor: Optional[float] = None  # YaRN: cos/sin multiplier (None: 0.1 ln(factor) + 1, the paper's)


def llama3_scaling(inv_freq: torch.Tensor, s: RopeScaling, base: float) -> Tuple[torch.Tensor, float]:
    """Llama 3.1: wavelengths longer than original/low_freq_factor are divided by the factor, shorter than
    original/high_freq_factor kept, and those between interpolated smoothly."""
    low, high, original = s.low_freq_factor, s.high_freq_factor, s.original_max_positions
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled), 1.0


def yarn_attention_factor(factor: float, mscale: float = 1.0) -> float:
    """YaRN's default cos/sin multiplier (its paper's sqrt(1/t) = 0.1 ln(s) + 1; DeepSeek's ``mscale`` multiplies
    the logarithm), 1 when nothing is stretched."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_scaling(inv_freq: torch.Tensor, s: RopeScaling, base: float) -> Tuple[torch.Tensor, float]:
    """YaRN: frequency pairs that turn more than beta_fast times over the original context keep their
    frequency (extrapolate), those turning fewer than beta_slow times are divided by the factor (interpolate),
    a linear ramp over the pair index between; the tables are multiplied by the attention factor. The
    correction range is rounded outwards (floor/ceil, transformers' ``truncate`` true)."""
    dim = 2 * inv_freq.numel()

    def pair_turning(rotations: float) -> float:  # the (fractional) pair index turning ``rotations`` times
        return dim * math.log(s.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(pair_turning(s.beta_fast)), 0)
    high = min(math.ceil(pair_turning(s.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(inv_freq.device)
    extrapolated = 1 - ramp
    scaled = inv_freq / s.factor * ramp + inv_freq * extrapolated
    factor = s.attention_factor if s.attention_factor is not None else yarn_attention_factor(s.factor)
    return scaled, factor


SCALINGS: Dict[str, Callable[[torch.Tensor, RopeScaling, float], Tuple[torch.Tensor, float]]] = {
    "llama3": llama3_scaling,
    "yarn": yarn_scaling,
}


def rope_frequencies(
    head_dim: int, theta: float, scaling: Optional[RopeScaling] = None, device=None
) -> Tuple[torch.Tensor, float]:
    """(the head_dim/2 angular frequencies theta^(-2i/head_dim), rescaled by ``scaling``; the attention factor)."""
    D = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D))
    if scaling is None:
        return inv_freq, 1.0
    return SCALINGS[scaling.kind](inv_freq, scaling, theta)


def rope_tables(
    inv_freq: torch.Tensor, positions: int, attention_factor: float = 1.0
) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, D] in fp32, each half of a head rotated by the same angles."""
    angles = torch.arange(positions, dtype=torch.int64, device=inv_freq.device).float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, D] by the angles of its positions (cos/sin [T, D] or [B, 1, T, D]), in fp32."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)
