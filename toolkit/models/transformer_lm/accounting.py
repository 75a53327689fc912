"""The N of ``transformer_lm``'s 6N training FLOPs per token, its adaptive input and softmax included.

An adaptive model does not use all of its output layer for every token. The head runs for every
position; tail band ``i`` runs only where the target is in that band, and only one band's input
projection runs per input token. ``matmul_parameters_per_token`` counts each of those weights by the
share of tokens that use it, estimated with Zipf's law over the frequency-sorted vocabulary
(``toolkit.models.adaptive.band_token_shares``; WikiText-103 at cutoffs 20000,60000: 80% / 8% / 12%).
"""

from __future__ import annotations

from typing import Sequence

import torch.nn as nn

from toolkit.models.adaptive import AdaptiveInput, AdaptiveSoftmax, band_token_shares, linear_weight


def _adaptive_input_per_token(embed: AdaptiveInput, shares: Sequence[float]) -> float:
    return sum(share * band[1].weight.numel() for share, band in zip(shares, embed.embeddings))


def _adaptive_softmax_per_token(asm: AdaptiveSoftmax, shares: Sequence[float]) -> float:
    """Head for every token (tied word scores included), tail i for the tokens of band i + 1."""
    x_dim = asm.input_dim
    total = float(asm.cutoff[0] + len(asm.tail)) * x_dim  # head scores: words + clusters
    head_proj = getattr(asm.head, "word_proj", None)
    if isinstance(head_proj, nn.Sequential):  # tied head with a projection to the band-0 dimension
        proj = head_proj[0].weight
        total += proj.numel() + float(asm.cutoff[0]) * (proj.shape[0] - x_dim)
    for i, tail in enumerate(asm.tail):
        size, dim = linear_weight(tail[2]).shape
        total += shares[i + 1] * (x_dim * dim + dim * size)
    return total


def matmul_parameters_per_token(model: nn.Module) -> int:
    """The N of 6N training FLOPs per token (see the module docstring for the adaptive parts)."""
    lookups = {"embed_tokens.weight", "embed_positions.weight", "output_projection.weight"}
    body = sum(
        p.numel()
        for name, p in model.named_parameters()
        if name not in lookups and not name.startswith(("embed_tokens.", "adaptive_softmax."))
    )
    embed, asm = model.embed_tokens, model.adaptive_softmax
    n = float(body)
    if isinstance(embed, AdaptiveInput):
        n += _adaptive_input_per_token(embed, band_token_shares(embed.cutoff))
    if asm is not None:
        n += _adaptive_softmax_per_token(asm, band_token_shares(asm.cutoff))
    elif model.output_projection is not None:
        n += model.output_projection.weight.numel()
    else:
        n += embed.weight.numel()  # tied output projection
    return int(round(n))
