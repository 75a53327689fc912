"""Group sample indices into batches by size (fairseq's ``batch_by_size``).

Indices are taken in the given order (usually sorted by size) and cut into
consecutive batches. A batch holds at most ``max_sentences`` samples and its
*padded* size, ``len(batch) * max(sizes in batch)``, is at most ``max_tokens``.
Each batch is the longest prefix that satisfies both limits, rounded down to a
multiple of ``required_batch_size_multiple`` when it holds at least that many
samples (the rest start the next batch). This matches fairseq's ``batch_by_size_vec``
(so only the very last batch, or one where fewer than the multiple fit, is not a
multiple).

The work is one numpy step per *batch*, not a Python step per sample.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from toolkit.core.errors import UserError


def _limit(value: Optional[int]) -> float:
    return float("inf") if value is None or value <= 0 else float(value)


def batch_by_size(
    indices: np.ndarray,
    sizes: np.ndarray,
    max_tokens: Optional[int] = None,
    max_sentences: Optional[int] = None,
    required_batch_size_multiple: int = 1,
) -> List[np.ndarray]:
    """Batches (int64 arrays of dataset indices) of ``indices`` in order.

    Args:
        indices: dataset indices, in the order batches are formed.
        sizes: tokens of every dataset sample (indexed by dataset index).
        max_tokens: limit on ``batch size * longest sample`` (None or <= 0: no limit).
        max_sentences: limit on samples per batch (``--batch-size``; None or <= 0: no limit).
        required_batch_size_multiple: batch sizes are multiples of this when possible.
    """
    indices = np.asarray(indices, dtype=np.int64)
    n = len(indices)
    if n == 0:
        return []
    lens = np.asarray(sizes, dtype=np.int64)[indices]
    tok_limit, sent_limit = _limit(max_tokens), _limit(max_sentences)
    mult = max(1, int(required_batch_size_multiple or 1))
    if tok_limit < float("inf"):
        too_long = np.flatnonzero(lens > tok_limit)
        if len(too_long):
            i = too_long[0]
            raise UserError(
                f"--max-tokens {max_tokens}: sample {indices[i]} has {lens[i]} tokens, more than a "
                f"whole batch may hold; raise --max-tokens or lower --tokens-per-sample"
            )

    batches: List[np.ndarray] = []
    start = 0
    while start < n:
        # A window long enough to contain the batch's end; doubled until it does.
        guess = sent_limit if sent_limit < float("inf") else tok_limit // max(int(lens[start]), 1) + 1
        window = int(min(n - start, max(guess, mult, 1)))
        while True:
            seg = lens[start : start + window]
            counts = np.arange(1, len(seg) + 1)
            ok = (counts <= sent_limit) & (counts * np.maximum.accumulate(seg) <= tok_limit)
            length = int(np.count_nonzero(ok))  # ok is True then False: a prefix
            if length < window or start + window >= n:
                break
            window = min(n - start, window * 2)
        if length >= mult:
            length -= length % mult
        batches.append(indices[start : start + length])
        start += length
    return batches


def filter_by_size(
    indices: np.ndarray, lengths: np.ndarray, max_positions: Optional[int]
) -> Tuple[np.ndarray, np.ndarray]:
    """``(kept, dropped)``: indices whose ``lengths[index]`` is at most ``max_positions``, and the rest."""
    indices = np.asarray(indices, dtype=np.int64)
    if max_positions is None:
        return indices, np.zeros(0, dtype=np.int64)
    too_long = np.asarray(lengths)[indices] > max_positions
    return indices[~too_long], indices[too_long]
