"""Rotary position embeddings: frequencies (optionally rescaled for a longer context), the cos/sin tables,
and the rotation, in Hugging Face's layout (the two halves of the rotated features turned together, not
interleaved pairs), the layout its checkpoints are stored in. Tables and rotation are fp32 (bf16 angles lose
positions beyond a few hundred).

A context-extension scheme is one function in ``SCALINGS``: ``(inverse frequencies, RopeScaling, base) ->
(rescaled inverse frequencies, attention factor)``; the factor multiplies cos and sin (YaRN's
``mscale``; 1.0 for Llama 3's and linear scaling, which then leave the tables untouched). Each computes what
transformers' ``_compute_llama3_parameters`` / ``_compute_yarn_parameters`` /
``_compute_linear_scaling_rope_parameters`` do, so imported checkpoints keep their logits.

Partial rotary (GPT-NeoX's ``rotary_pct``, Phi's and Qwen3-Next's ``partial_rotary_factor``): the tables are
as wide as the rotated features, int(head size x factor), frequencies computed over that width; ``apply_rope``
turns the first ``cos.size(-1)`` features of each head and passes the rest through, as transformers'
``apply_rotary_pos_emb`` does.

``decoder_tables`` reads a rotary decoder family's options (``common/options.py``); which table a layer rotates
with is the model's ``rope_table`` (``common/decoder.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from toolkit.models.common.options import rotary_dim


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
    truncate: bool = True  # YaRN: the correction range rounded outwards to whole pairs (gpt-oss: false, exact)


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
    correction range is rounded outwards (floor/ceil, transformers' ``truncate`` true) or kept fractional
    (``truncate`` false: gpt-oss)."""
    dim = 2 * inv_freq.numel()

    def pair_turning(rotations: float) -> float:  # the (fractional) pair index turning ``rotations`` times
        return dim * math.log(s.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(s.beta_fast), pair_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(inv_freq.device)
    extrapolated = 1 - ramp
    scaled = inv_freq / s.factor * ramp + inv_freq * extrapolated
    factor = s.attention_factor if s.attention_factor is not None else yarn_attention_factor(s.factor)
    return scaled, factor


def linear_scaling(inv_freq: torch.Tensor, s: RopeScaling, base: float) -> Tuple[torch.Tensor, float]:
    """Every frequency divided by the factor: position t turns as t / factor did (position interpolation)."""
    return inv_freq / s.factor, 1.0


SCALINGS: Dict[str, Callable[[torch.Tensor, RopeScaling, float], Tuple[torch.Tensor, float]]] = {
    "llama3": llama3_scaling,
    "yarn": yarn_scaling,
    "linear": linear_scaling,
}


def rope_frequencies(
    rotary_dim: int, theta: float, scaling: Optional[RopeScaling] = None, device=None
) -> Tuple[torch.Tensor, float]:
    """(the rotary_dim/2 angular frequencies theta^(-2i/rotary_dim), rescaled by ``scaling``; the attention
    factor). ``rotary_dim``: the rotated features of a head (the head size, or its partial share)."""
    D = rotary_dim
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
    """Rotate x [B, heads, T, D] by the angles of its positions (cos/sin [T, R] or [B, 1, T, R]), in fp32: the
    first R features of each head (R = D unless the rotation is partial), the others passed through."""
    rotated_width = cos.size(-1)
    if rotated_width < x.size(-1):
        return torch.cat([apply_rope(x[..., :rotated_width], cos, sin), x[..., rotated_width:]], dim=-1)
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def decoder_scaling(cfg) -> Optional[RopeScaling]:
    """``--rope-scaling``'s frequency scaling when ``--rope-scaling-factor`` is set, else None."""
    if cfg.rope_scaling_factor is None:
        return None
    return RopeScaling(
        factor=cfg.rope_scaling_factor,
        kind=cfg.rope_scaling,
        low_freq_factor=cfg.rope_low_freq_factor,
        high_freq_factor=cfg.rope_high_freq_factor,
        original_max_positions=cfg.rope_original_max_positions,
        beta_fast=cfg.rope_yarn_beta_fast,
        beta_slow=cfg.rope_yarn_beta_slow,
        attention_factor=cfg.rope_attention_factor,
        truncate=cfg.rope_yarn_truncate,
    )


def decoder_tables(
    cfg, positions: int, device=None, local_theta: Optional[float] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, R] in fp32 of a rotary decoder family's options (R: ``options.rotary_dim``);
    ``local_theta``: the local layers' tables, of their own base and unscaled (Gemma 3's)."""
    if local_theta is not None:
        inv_freq, factor = rope_frequencies(rotary_dim(cfg), local_theta, None, device)
    else:
        inv_freq, factor = rope_frequencies(rotary_dim(cfg), cfg.rope_theta, decoder_scaling(cfg), device)
    return rope_tables(inv_freq, positions, factor)
