"""One search step: which candidates extend which hypotheses (fairseq's ``search.py`` semantics).

Shapes: ``lprobs`` [B, K, V] log-probabilities of the next token for the K hypotheses
of each of B prompts; ``cum_scores`` [B, K] the hypotheses' summed log-probabilities.
Each step returns candidates (score, token, beam) [B, C], best first for beam search:
the caller finalizes those ending in ``</s>`` and continues the first K others.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

Candidates = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def beam_search_step(lprobs: torch.Tensor, cum_scores: torch.Tensor) -> Candidates:
    """The 2K best one-token extensions over all hypotheses of a prompt.

    2K so that K of them remain after up to K end in ``</s>``. Hypotheses that are not
    alive carry ``-inf`` scores, so at the first step only one hypothesis expands, as
    fairseq's "use only the first beam" rule.
    """
    B, K, V = lprobs.shape
    total = (lprobs + cum_scores.unsqueeze(-1)).view(B, K * V)
    scores, flat = total.topk(min(2 * K, K * V - 1), dim=1)
    return scores, flat % V, torch.div(flat, V, rounding_mode="floor")


def top_p_mask(lprobs: torch.Tensor, p: float) -> torch.Tensor:
    """True for tokens outside the smallest set, most probable first, whose mass reaches ``p``.

    A token is kept when the mass of the tokens ranked before it is still below ``p``
    (fairseq's ``cumsum < p`` plus the one token that crosses it).
    """
    probs = lprobs.exp()
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= p
    drop_sorted[..., 0] = False
    return torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)


def sample_step(
    lprobs: torch.Tensor,
    cum_scores: torch.Tensor,
    topk: int = -1,
    topp: float = -1.0,
    generator: Optional[torch.Generator] = None,
) -> Candidates:
    """Each hypothesis draws its next token from its own (top-k / top-p truncated) distribution.

    The token's score is its untruncated log-probability, as fairseq's ``Sampling``
    (truncation chooses the support, it does not renormalize the score). Top-p wins
    over top-k when both are given, as in fairseq.
    """
    B, K, V = lprobs.shape
    allowed = lprobs
    if topp > 0:
        allowed = lprobs.masked_fill(top_p_mask(lprobs, topp), -math.inf)
    elif topk > 0:
        kth = lprobs.topk(min(topk, V), dim=-1).values[..., -1:]
        allowed = lprobs.masked_fill(lprobs < kth, -math.inf)
    # softmax, not exp: a distribution whose every probability underflows still samples
    probs = torch.softmax(allowed.view(B * K, V), dim=-1)
    tokens = torch.multinomial(probs, 1, replacement=True, generator=generator).view(B, K)
    scores = lprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) + cum_scores
    beams = torch.arange(K, device=lprobs.device).expand(B, K)
    return scores, tokens, beams


def block_repeated_ngrams(tokens: torch.Tensor, lprobs: torch.Tensor, n: int, rows: Optional[List[int]] = None) -> None:
    """Set to -inf every token that would complete an n-gram already present in its row.

    ``tokens`` [R, S] are the rows so far (``<s>``/``</s>`` at position 0 included, as
    fairseq's); ``lprobs`` [R, V] is changed in place; ``rows`` limits the rows checked.
    """
    if n <= 0 or tokens.size(1) < n:
        return
    seqs = tokens.tolist()
    for r in range(len(seqs)) if rows is None else rows:
        seq = seqs[r]
        tail = seq[len(seq) - n + 1 :] if n > 1 else []
        banned = [seq[i + n - 1] for i in range(len(seq) - n + 1) if seq[i : i + n - 1] == tail]
        if banned:
            lprobs[r, banned] = -math.inf
