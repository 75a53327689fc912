"""A tiny adaptive-input / adaptive-softmax transformer_lm and its token batches, for both tiers' adaptive tests."""

from __future__ import annotations

import torch

from toolkit.models.transformer_lm import TransformerLanguageModel, TransformerLMConfig

V, PAD, C = 37, 1, 32
CUTOFF = [10, 20, V]  # "10,20" with the vocabulary size appended


def cfg(**overrides) -> TransformerLMConfig:
    values = dict(
        decoder_layers=2,
        decoder_embed_dim=C,
        decoder_ffn_embed_dim=64,
        decoder_attention_heads=4,
        max_target_positions=16,
        dropout=0.0,
        adaptive_input=True,
        adaptive_input_cutoff="10,20",
        adaptive_softmax_cutoff="10,20",
        adaptive_input_factor=2.0,
        adaptive_softmax_factor=2.0,
        tie_adaptive_weights=True,
        tie_adaptive_proj=True,
    )
    values.update(overrides)
    return TransformerLMConfig(**values)


def model(seed=0, **overrides) -> TransformerLanguageModel:
    return TransformerLanguageModel(cfg(**overrides), V, PAD, seed=seed).eval()


def tokens(B=3, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(PAD + 1, V, (B, T), generator=g)
    x[0, :3] = torch.tensor([2, 12, 30])  # one token of every band
    return x
