"""fairseq's ``--shorten-method truncate|random_crop`` (``maybe_shorten_dataset``) over a whole split.

fairseq wraps the split in ``TruncateDataset`` (an item's first ``tokens_per_sample``
tokens) or ``RandomCropDataset`` (a window of that many tokens starting at
``randint(0, excess)`` drawn under ``numpy_seed(seed, epoch, index)``) before cutting
blocks. The language-model stack above it does not pass the epoch down, so the crop
of an item is the same every epoch (epoch 0); this matches that.

Here the shortened split is materialized once as a flat token array plus sizes (what
:class:`~toolkit.data.token_block_dataset.TokenBlockDataset` cuts blocks from), with
one random draw per item that is too long, not one per item.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from toolkit.config.components import SHORTEN_METHODS  # noqa: F401  (the names, torch-free for --help)

CROP_EPOCH = 0  # what fairseq's RandomCropDataset sees under its language-model task


def fairseq_numpy_seed(seed: int, *extra: int) -> int:
    """The seed fairseq's ``data_utils.numpy_seed(seed, *extra)`` sets."""
    return int(hash((seed, *extra)) % 1e6) if extra else seed


def applies_to(split: str, split_list: Optional[str]) -> bool:
    """fairseq: every split when ``--shorten-data-split-list`` is empty, else only the listed ones."""
    return not split_list or split in split_list.split(",")


def crop_starts(sizes: np.ndarray, length: int, seed: int) -> np.ndarray:
    """Offset of each item's window inside the item (0 unless it is longer than ``length``)."""
    starts = np.zeros(len(sizes), dtype=np.int64)
    excess = sizes - length
    state = np.random.get_state()
    try:
        for index in np.flatnonzero(excess > 0).tolist():
            np.random.seed(fairseq_numpy_seed(seed, CROP_EPOCH, index))
            starts[index] = np.random.randint(0, int(excess[index]))
    finally:
        np.random.set_state(state)
    return starts


class ShortenedDataset:
    """A split whose items are cut to at most ``length`` tokens (``.sizes`` and flat ``.tokens``)."""

    def __init__(self, dataset, length: int, method: str, seed: int = 1):
        if method not in SHORTEN_METHODS[1:]:
            raise ValueError(f"--shorten-method: {method!r} is not one of {', '.join(SHORTEN_METHODS)}")
        from toolkit.data.token_block_dataset import TokenBlockDataset

        sizes = np.asarray(dataset.sizes, dtype=np.int64)
        flat = TokenBlockDataset.flat_tokens(dataset, sizes)
        offsets = np.concatenate([[0], np.cumsum(sizes)])[:-1]
        if method == "random_crop":
            offsets = offsets + crop_starts(sizes, length, seed)
        self.sizes = np.minimum(sizes, length)
        new_offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        shift = np.repeat(offsets - new_offsets[:-1], self.sizes)
        self.tokens = flat[np.arange(int(new_offsets[-1]), dtype=np.int64) + shift]
        self._offsets = new_offsets

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.tokens[self._offsets[index] : self._offsets[index + 1]]
