"""Several binarized splits read as one (fairseq's ``load_indexed_dataset(..., combine=True)``).

fairseq's ``--combine-val`` loads ``valid``, ``valid1``, ``valid2``, ... (until one is missing) and
concatenates them before cutting token blocks, so a block may run from the end of one split into
the next, exactly as if they were one file. :class:`TokenBlockDataset` reads ``.tokens`` (all
items back to back) and ``.sizes``; this provides both for the splits in order.
"""

from __future__ import annotations

import itertools
import os
from typing import List

import numpy as np
import torch

from toolkit.data.indexed_dataset import MMapIndexedDataset


def numbered_splits(data_path: str, split: str) -> List[str]:
    """``split``, ``split1``, ``split2``, ... as long as they exist in ``data_path`` (fairseq's order)."""
    found = []
    for k in itertools.count():
        name = split + (str(k) if k > 0 else "")
        if not MMapIndexedDataset.exists(os.path.join(data_path, name)):
            return found
        found.append(name)
    return found


class ConcatIndexedDataset(torch.utils.data.Dataset):
    def __init__(self, parts: List[MMapIndexedDataset]):
        self.parts = parts
        self.prefix = parts[0].prefix if parts else None
        self.sizes = np.concatenate([np.asarray(p.sizes, dtype=np.int64) for p in parts])
        self._tokens = np.concatenate([np.asarray(p.tokens, dtype=np.int64) for p in parts])
        self._starts = np.concatenate([[0], np.cumsum(self.sizes)])

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self._tokens[self._starts[i] : self._starts[i + 1]].copy())

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens

    def num_tokens(self, i: int) -> int:
        return int(self.sizes[i])
