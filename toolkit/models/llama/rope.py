"""Rotary embeddings of the Llama family: ``toolkit.models.blocks.rope`` with the family's options
(``--rope-theta``, ``--rope-scaling llama3|yarn`` with ``--rope-scaling-factor`` ...). Their own module so that both the model and its
cached forward for ONNX (``cached.py``, which ``model.py`` names in ``onnx_cached_decoder``) use them
without importing each other.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from toolkit.models.blocks import rope
from toolkit.models.blocks.rope import RopeScaling, apply_rope  # noqa: F401  (imported from here before)
from toolkit.models.llama.config import LlamaConfig, head_dim


def rope_scaling(cfg: LlamaConfig) -> Optional[RopeScaling]:
    """``--rope-scaling``'s frequency scaling (Llama 3.1's or YaRN) when ``--rope-scaling-factor`` is set, else None."""
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
    )


def rope_frequencies(cfg: LlamaConfig, device=None) -> torch.Tensor:
    """The D/2 angular frequencies theta^(-2i/D), rescaled when ``--rope-scaling-factor`` is set."""
    return rope.rope_frequencies(head_dim(cfg), cfg.rope_theta, rope_scaling(cfg), device)[0]


def rope_tables(
    cfg: LlamaConfig, positions: int, device=None, local: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, D] in fp32, each half of a head rotated by the same angles; ``local``: the
    sliding_attention layers' tables (--rope-local-theta, unscaled, Gemma 3)."""
    if local:
        inv_freq, factor = rope.rope_frequencies(head_dim(cfg), cfg.rope_local_theta, None, device)
        return rope.rope_tables(inv_freq, positions, factor)
    inv_freq, factor = rope.rope_frequencies(head_dim(cfg), cfg.rope_theta, rope_scaling(cfg), device)
    return rope.rope_tables(inv_freq, positions, factor)
