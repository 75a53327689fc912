"""The KV cache of incremental decoding: what one layer keeps of the positions decoded so far.

What a position leaves behind is its attention variant's choice (``AttentionLayer.project``'s *entries*): the keys
and values of its G key/value heads for multi-head, grouped and multi-query attention, a compressed latent and
a shared rotary key for latent attention. The cache stores those tensors as they come, positions on dim 2, and
the variant expands them into keys and values (``AttentionLayer.keys_values``) at each step.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


class KVCache:
    """One layer's cached entries, each [B, *, P, *] (positions on dim 2).

    Buffers grow by doubling, so appending one position per step copies nothing in the common case (torch.cat would
    copy the whole prefix every step).
    """

    def __init__(self):
        self.buffers: Optional[Tuple[torch.Tensor, ...]] = None
        self.length = 0

    def append(self, *entries: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Store ``entries`` (each [B, *, T, *]) after the cached positions; return each entry's positions so far."""
        P, T = self.length, entries[0].size(2)
        if self.buffers is None or P + T > self.buffers[0].size(2):
            capacity = max(P + T, 2 * (0 if self.buffers is None else self.buffers[0].size(2)))
            grown = tuple(e.new_empty(e.size(0), e.size(1), capacity, *e.shape[3:]) for e in entries)
            if P > 0:
                for new, old in zip(grown, self.buffers):
                    new[:, :, :P] = old[:, :, :P]
            self.buffers = grown
        for buffer, entry in zip(self.buffers, entries):
            buffer[:, :, P : P + T] = entry
        self.length = P + T
        return tuple(buffer[:, :, : P + T] for buffer in self.buffers)

    def keep_last(self, n: int) -> None:
        """Forget all but the last ``n`` positions (a sliding-window layer never reads older keys again),
        so a local layer's cache stays window-sized however long generation runs."""
        L = self.length
        if L > n:
            for buffer in self.buffers:
                buffer[:, :, :n] = buffer[:, :, L - n : L].clone()
            self.length = n

    def reorder(self, new_order: torch.Tensor) -> None:
        """Keep rows ``new_order`` (beam search picks which hypotheses continue; finished rows leave)."""
        if self.buffers is None:
            return
        L = self.length  # copy the filled positions only, keep the capacity
        reordered = []
        for buffer in self.buffers:
            kept = buffer.new_empty((len(new_order),) + buffer.shape[1:])
            kept[:, :, :L] = buffer[new_order, :, :L]
            reordered.append(kept)
        self.buffers = tuple(reordered)
