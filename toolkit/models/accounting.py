"""Parameter and FLOP accounting of the models, ``transformer_lm``'s adaptive input/softmax included.

    python -m toolkit.models.accounting transformer_lm_wiki103 --vocab-size 267744
    python -m toolkit.models.accounting llama3_1b qwen2_0_5b     # at their published vocabularies

prints the parameter count of a named architecture by part (built on the meta device, no memory).
Without ``--vocab-size`` a Llama-family size counts at its own published vocabulary
(``toolkit.models.llama.archs.PUBLISHED_VOCAB_SIZE``), anything else at GPT-2's 50257.

FLOPs: an adaptive model does not use all of its output layer for every token. The head runs for
every position; tail band ``i`` runs only where the target is in that band, and only one band's
input projection runs per input token. ``matmul_parameters_per_token`` counts each of those weights
by the share of tokens that use it, estimated with Zipf's law over the frequency-sorted vocabulary
(``adaptive.band_token_shares``; WikiText-103 at cutoffs 20000,60000: 80% / 8% / 12%).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import torch.nn as nn

from toolkit.models.adaptive import AdaptiveInput, AdaptiveSoftmax, band_token_shares, linear_weight


def _numel(module: Optional[nn.Module]) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


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
    body = sum(p.numel() for name, p in model.named_parameters()
               if name not in lookups and not name.startswith(("embed_tokens.", "adaptive_softmax.")))
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


def parameter_breakdown(model: nn.Module) -> Dict[str, int]:
    """Parameters (tied ones once) by part: embeddings, layers, output layer, other, total."""
    part_names = ("embed_tokens", "embed_positions", "layers", "adaptive_softmax", "output_projection")
    parts = {name: _numel(getattr(model, name, None)) for name in part_names}  # a family may lack some
    total = sum(p.numel() for p in model.parameters())
    parts["other"] = total - sum(parts.values())
    parts["total"] = total
    return parts


def count_parameters(arch: str, vocab_size: int = 50257, tokens_per_sample: int = 2048, verbose: bool = False,
                     **overrides: Any) -> int:
    """Parameters of a named architecture (tied ones once); ``verbose`` prints them by part."""
    from toolkit.models import build_on_meta

    model = build_on_meta(arch, vocab_size, tokens_per_sample, **overrides)
    parts = parameter_breakdown(model)
    if verbose:
        print(f"{arch} at V={vocab_size:,}: " + ", ".join(f"{k} {v:,}" for k, v in parts.items() if v))
    return parts["total"]


def main(argv: Optional[Sequence[str]] = None) -> None:
    from toolkit.config.options import OneLineErrorParser

    parser = OneLineErrorParser(prog="python -m toolkit.models.accounting",
                                description="Parameter counts of named architectures.")
    parser.add_argument("arch", nargs="+")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="dictionary size (default: the arch's published one, else 50257)")
    parser.add_argument("--tokens-per-sample", type=int, default=2048)
    args = parser.parse_args(argv)
    for arch in args.arch:
        count_parameters(arch, args.vocab_size or default_vocab_size(arch), args.tokens_per_sample, verbose=True)


def default_vocab_size(arch: str) -> int:
    """The vocabulary a named size was published with (the Llama family), else GPT-2's."""
    from toolkit.models.llama.archs import PUBLISHED_VOCAB_SIZE

    return PUBLISHED_VOCAB_SIZE.get(arch, 50257)


if __name__ == "__main__":
    main()
