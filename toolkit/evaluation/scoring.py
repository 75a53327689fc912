"""Log-likelihoods of token requests through the library's one scorer (``inference``).

``loglikelihood_tokens`` follows lm-evaluation-harness's ``hf`` model: a request is a context
and a continuation (ids, the context starting with the symbol the LM sees before a text); the
input is ``(context + continuation)[-(max_length + 1):][:-1]``, so a request longer than the
model's positions loses tokens from the left, and the continuation is scored at the input's
last positions (only those are normalized: no [B, T, V] softmax). Requests are sorted by input
length (longest first) and batched, right-padded; requests with the same input (e.g. one-token
answers to one question) share one forward pass.

A whole document (``loglikelihood_rolling``) is scored as such requests too, one per window
(``toolkit.evaluation.harness.rolling_windows``), as lm-evaluation-harness's ``hf`` model scores it.
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from toolkit import inference
from toolkit.core.errors import UserError

Pair = Tuple[Sequence[int], Sequence[int]]


def request_input(context: Sequence[int], continuation: Sequence[int], max_length: int) -> Tuple[int, ...]:
    """The tokens fed to the model: the last ``max_length`` of context + continuation minus its last token."""
    if not continuation:
        raise UserError("loglikelihood: a request with an empty continuation has nothing to score")
    if len(continuation) > max_length:
        raise UserError(
            f"loglikelihood: a continuation of {len(continuation)} tokens is longer than the "
            f"model's {max_length} positions"
        )
    return tuple((list(context) + list(continuation))[-(max_length + 1) :][:-1])


@torch.no_grad()
def loglikelihood_tokens(
    models: List[torch.nn.Module],
    pairs: Sequence[Pair],
    max_length: int,
    pad: int,
    batch_size: int = 8,
    device: torch.device = torch.device("cpu"),
) -> List[Tuple[float, bool]]:
    """(sum of the continuation's log-probabilities, whether greedy decoding gives it) per request."""
    inputs = [request_input(ctx, cont, max_length) for ctx, cont in pairs]
    distinct: Dict[Tuple[int, ...], List[int]] = {}
    for i, key in enumerate(inputs):
        distinct.setdefault(key, []).append(i)
    order = sorted(distinct, key=lambda key: (-len(key), key))
    results: List[Tuple[float, bool]] = [(0.0, False)] * len(pairs)
    for first in range(0, len(order), max(1, batch_size)):
        keys = order[first : first + max(1, batch_size)]
        width = max(len(pairs[i][1]) for key in keys for i in distinct[key])
        batch = torch.full((len(keys), len(keys[0])), pad, dtype=torch.long)
        positions = torch.zeros(len(keys), width, dtype=torch.long)
        for row, key in enumerate(keys):
            batch[row, : len(key)] = torch.tensor(key, dtype=torch.long)
            positions[row] = torch.arange(len(key) - width, len(key)).clamp(min=0)
        logp = inference.ensemble_log_probs(models, batch.to(device), positions.to(device))  # [B, width, V]
        for row, key in enumerate(keys):
            for i in distinct[key]:
                results[i] = _continuation_score(logp[row], pairs[i][1])
    return results


def _continuation_score(logp: torch.Tensor, continuation: Sequence[int]) -> Tuple[float, bool]:
    """``logp``: [width, V], the row's last positions; the continuation is scored at its last ones."""
    cont = torch.tensor(list(continuation), dtype=torch.long, device=logp.device)
    rows = logp[logp.size(0) - len(cont) :]
    greedy = bool((rows.argmax(dim=-1) == cont).all())
    return float(rows.gather(1, cont[:, None]).sum()), greedy
