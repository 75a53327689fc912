"""Weighted mixtures of data-bins: ``--data-mixture web=data-bin/web:0.7,code=data-bin/code:0.3``.

An epoch of the mixture is ``--mixture-epoch-samples`` samples (default: all sources'
samples together). Source ``s`` gets ``round(w_s * N)`` of them (largest remainders, so
they add up to N), placed at evenly spaced points of the epoch's order (a seeded phase
per source): any stretch of the order holds each source within one sample of its share,
so every batch already has the mixture's proportions. The samples of a source are taken
from seeded permutations of it, one after the other (a source smaller than its share is
repeated, each pass in a new order).

The order depends only on the seed and the sources, and the mixture is one map-style
dataset over the sources' samples, so the existing batching, sharding over replicas and
sample-position resume (``toolkit.data.sample_position``) apply to it unchanged: a
resume, with the same or other batching and replicas, continues the same draw.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

import numpy as np

from toolkit.core.errors import UserError

FLAG = "--data-mixture"


@dataclass(frozen=True)
class Source:
    name: str
    path: str
    weight: float  # normalized: the weights add up to 1


def parse_mixture(spec: str) -> List[Source]:
    """``NAME=PATH:WEIGHT,...`` -> sources with weights normalized to sum 1; bad specs are one UserError."""
    sources, raw = [], []
    for part in (p.strip() for p in spec.split(",")):
        name, eq, rest = part.partition("=")
        path, colon, weight = rest.rpartition(":")
        if not (eq and colon and name and path):
            raise UserError(
                f"{FLAG} {spec}: {part!r} is not NAME=PATH:WEIGHT; write e.g. "
                f"web=data-bin/web:0.7,code=data-bin/code:0.3"
            )
        if not name.replace("-", "").replace("_", "").isalnum():
            raise UserError(
                f"{FLAG} {spec}: source name {name!r} may hold only letters, digits, - and _ "
                f"(it names the valid_{name} log lines)"
            )
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not (w > 0 and np.isfinite(w)):
            raise UserError(f"{FLAG} {spec}: the weight of {name} ({weight!r}) must be a positive number")
        if name in (s[0] for s in raw):
            raise UserError(f"{FLAG} {spec}: source {name} is named twice; give each source its own name")
        raw.append((name, path, w))
    for (name, path, _), share in zip(raw, normalized([w for _, _, w in raw])):
        if not os.path.isdir(path):
            raise UserError(f"{FLAG}: {name}={path}: no such data-bin folder; check the path")
        if share <= 0:
            raise UserError(
                f"{FLAG} {spec}: the weight of {name} is too small next to the others to be "
                f"drawn at all (its share rounds to 0); give weights closer to each other"
            )
        sources.append(Source(name, path, share))
    return sources


def normalized(weights: Sequence[float]) -> List[float]:
    """Weights as shares adding up to 1. Where their plain sum overflows (1e308 + 1e308 is inf, which made
    every share 0 and the epoch one batch) they are scaled by the largest first; otherwise the plain
    division, so the shares (and the draw) of every other spec stay bit for bit what they were."""
    total = sum(weights)
    if not math.isfinite(total):
        largest = max(weights)
        weights = [w / largest for w in weights]
        total = sum(weights)
    return [w / total for w in weights]


def source_counts(weights: Sequence[float], total: int) -> np.ndarray:
    """Samples of each source in an epoch of ``total``: ``w * total`` rounded by largest remainder."""
    exact = np.asarray(weights, dtype=np.float64) * total
    counts = np.floor(exact).astype(np.int64)
    short = int(total - counts.sum())
    if short > 0:
        counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


def source_sequence(counts: np.ndarray, seed: int) -> np.ndarray:
    """Which source each position of the epoch takes: source s at the points ``(k + phase_s) / count_s``."""
    phases = np.random.default_rng([seed, 7919]).random(len(counts))
    times = [(np.arange(c) + phases[s]) / c for s, c in enumerate(counts) if c > 0]
    labels = [np.full(c, s, dtype=np.int64) for s, c in enumerate(counts) if c > 0]
    if not times:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(labels)[np.argsort(np.concatenate(times), kind="stable")]


def draws(num_samples: int, count: int, seed: int, source: int) -> np.ndarray:
    """``count`` samples of a source of ``num_samples``: seeded permutations of it, one after the other."""
    passes = -(-count // num_samples)
    perms = [np.random.default_rng([seed, source, p]).permutation(num_samples) for p in range(passes)]
    return np.concatenate(perms)[:count] if perms else np.zeros(0, dtype=np.int64)


def mixture_order(source_sizes: Sequence[int], weights: Sequence[float], total: int, seed: int) -> np.ndarray:
    """The epoch's sample order as (source, sample of that source) pairs, shape [total, 2]."""
    counts = source_counts(weights, total)
    sequence = source_sequence(counts, seed)
    local = np.zeros(len(sequence), dtype=np.int64)
    for s, (n, c) in enumerate(zip(source_sizes, counts)):
        if c:
            local[sequence == s] = draws(int(n), int(c), seed, s)
    return np.stack([sequence, local], axis=1)


class MixtureDataset:
    """The sources' samples as one dataset (index = offset of the source + its index); ``ordered_indices``
    is the weighted draw (:func:`mixture_order`)."""

    def __init__(self, sources: Sequence[Source], datasets: Sequence[Any], num_samples: int = 0):
        empty = [s.name for s, d in zip(sources, datasets) if len(d) == 0]
        if empty:
            raise UserError(f"{FLAG}: source {empty[0]} has no samples; binarize data into it or drop it")
        self.sources, self.datasets = list(sources), list(datasets)
        lengths = [len(d) for d in datasets]
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.sizes = np.concatenate([np.asarray(d.sizes, dtype=np.int64) for d in datasets])
        self.num_samples = int(num_samples) or int(self.offsets[-1])
        self._orders: Dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, index: int):
        s = int(np.searchsorted(self.offsets, index, side="right") - 1)
        return s, int(index - self.offsets[s])

    def __getitem__(self, index: int) -> Dict[str, Any]:
        s, local = self.locate(index)
        sample = self.datasets[s][local]
        sample["id"] = index
        return sample

    def ordered_indices(self, seed: int = 1) -> np.ndarray:
        if seed not in self._orders:
            order = mixture_order(
                [len(d) for d in self.datasets], [s.weight for s in self.sources], self.num_samples, seed
            )
            self._orders[seed] = self.offsets[order[:, 0]] + order[:, 1]
        return self._orders[seed]

    def seq_lengths(self) -> np.ndarray:
        return np.concatenate([d.seq_lengths() for d in self.datasets])

    def num_tokens(self, index: int) -> int:
        return int(self.sizes[index])

    def size(self, index: int) -> int:
        return int(self.sizes[index])

    def collater(self, samples: List[Dict[str, Any]]) -> Dict[str, Any]:
        return self.datasets[0].collater(samples)

    def set_epoch(self, epoch: int) -> None:  # the draw is the same each epoch; the batch order is reshuffled
        pass

    def source_of(self, indices: np.ndarray) -> np.ndarray:
        """The source number of each index (for counting what was drawn)."""
        return np.searchsorted(self.offsets, np.asarray(indices), side="right") - 1
