"""Rotary position embeddings of the Llama family: frequencies (with Llama 3.1's scaling), the cos/sin tables,
and the rotation. Their own module so that both the model and its cached forward for ONNX (``cached.py``,
which ``model.py`` names in ``onnx_cached_decoder``) use them without importing each other.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

from toolkit.models.llama.config import LlamaConfig, head_dim


def rope_frequencies(cfg: LlamaConfig, device=None) -> torch.Tensor:
    """The D/2 angular frequencies theta^(-2i/D), with Llama 3.1's scaling when ``--rope-scaling-factor`` is set:
    wavelengths longer than original/low_freq_factor are divided by the factor, shorter than
    original/high_freq_factor kept, and those between interpolated smoothly."""
    D = head_dim(cfg)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D))
    factor = cfg.rope_scaling_factor
    if factor is None:
        return inv_freq
    low, high, original = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_positions
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled)


def rope_tables(cfg: LlamaConfig, positions: int, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, D] in fp32, each half of a head rotated by the same angles."""
    inv_freq = rope_frequencies(cfg, device)
    angles = torch.arange(positions, dtype=torch.int64, device=device).float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, D] by the angles of its positions (cos/sin [T, D]), in fp32."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)
