"""A tiny transformer_lm (in-process) and its token batches, shared by the model tests of both tiers."""

from __future__ import annotations

import torch

from toolkit.models.transformer_lm import TransformerLanguageModel, TransformerLMConfig

VOCAB, PAD = 37, 1


def tiny_cfg(**overrides) -> TransformerLMConfig:
    values = dict(
        decoder_layers=2,
        decoder_embed_dim=32,
        decoder_ffn_embed_dim=64,
        decoder_attention_heads=4,
        max_target_positions=16,
        dropout=0.0,
    )
    values.update(overrides)
    return TransformerLMConfig(**values)


def tiny_model(seed=0, **overrides) -> TransformerLanguageModel:
    return TransformerLanguageModel(tiny_cfg(**overrides), VOCAB, PAD, seed=seed)


def tokens(B=3, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(PAD + 1, VOCAB, (B, T), generator=g)
