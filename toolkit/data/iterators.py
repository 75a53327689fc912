"""Resumable, sharded, per-epoch batch iteration (fairseq's ``EpochBatchIterator``).

Order of the batches in epoch ``e``: the fixed batch list (``batch_sampler``) is
shuffled with ``np.random.RandomState(seed + e)`` (the same permutation fairseq
draws), then rank ``r`` of ``W`` takes batches ``r, r + W, r + 2W, ...``. Every rank
gets ``ceil(num_batches / W)`` batches, so collective operations stay in step:

Dummy batches
    A rank whose share is one short gets, in last place, a copy of the epoch's
    first batch marked ``sample["is_dummy"] = True`` with ``ntokens`` and
    ``nsentences`` set to 0. It is a real batch (forward/backward run as usual,
    which FSDP needs); the trainer and the criterion give it zero weight. Every
    sample this iterator yields carries ``"is_dummy"`` (False for real batches).

Because of this, W ranks with ``--update-freq 1`` see the same batches per update
as one rank with ``--update-freq W``.

``state_dict()`` / ``load_state_dict()`` save and restore the position inside an
epoch; the next ``next_epoch_itr()`` then resumes that epoch after the batches
already consumed (without loading them). ``num_workers=0`` collates in the calling
process; ``num_workers >= 1`` uses that many ``DataLoader`` worker processes.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import traceback
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch

from toolkit.data.sample_position import Batching, EpochPlan, resume_plan, sampler_state, samples_consumed
from toolkit.core.errors import UserError


class CountingIterator:
    """Wraps an iterable and counts what it has yielded.

    Attributes:
        n: items consumed so far, counting the ``start`` offset (batches skipped on resume).
    """

    def __init__(self, iterable: Iterable, start: int = 0, total: Optional[int] = None):
        self._itr = iter(iterable)
        self.n = start
        self.total = total if total is not None else start + len(iterable)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self.total

    def __iter__(self) -> CountingIterator:
        return self

    def __next__(self) -> Any:
        if self.n >= self.total:
            raise StopIteration
        try:
            x = next(self._itr)
        except StopIteration:
            raise IndexError(f"iterator expected to have {self.total} items but ended after {self.n}") from None
        self.n += 1
        return x

    def has_next(self) -> bool:
        return self.n < self.total

    def skip(self, k: int) -> CountingIterator:
        for _ in range(k):
            next(self)
        return self

    def take(self, n: int) -> CountingIterator:
        """Stop after ``n`` items in all (counting those already consumed)."""
        self.total = min(self.total, n)
        self._itr = itertools.islice(self._itr, max(self.total - self.n, 0))
        return self


class _BatchLoader(torch.utils.data.Dataset):
    """Item k = collated batch k of one rank's epoch list (what DataLoader workers run)."""

    def __init__(self, dataset, collate_fn: Callable, batches: Sequence[np.ndarray], num_real: int):
        self.dataset, self.collate_fn = dataset, collate_fn
        self.batches, self.num_real = batches, num_real

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k: int) -> Dict[str, Any]:
        sample = self.collate_fn([self.dataset[int(i)] for i in self.batches[k]])
        if k >= self.num_real:
            sample["is_dummy"] = True
            sample["ntokens"] = 0
            sample["nsentences"] = 0
        else:
            sample["is_dummy"] = False
        return sample


class EpochBatchIterator:
    """Iterates one rank's share of a fixed list of batches, epoch after epoch.

    Args:
        dataset: map-style dataset (``dataset[i]`` is one sample).
        collate_fn: merges a list of samples into a batch dict.
        batch_sampler: the batches, each a sequence of dataset indices.
        seed: the epoch's batch order is drawn from ``RandomState(seed + epoch)``.
        num_shards, shard_id: data-parallel world size and this rank.
        num_workers: 0 loads in this process; N >= 1 uses N DataLoader workers.
        epoch: the epoch that the first ``next_epoch_itr()`` starts (1-based).
    """

    def __init__(
        self,
        dataset,
        collate_fn: Callable,
        batch_sampler: Iterable[Sequence[int]],
        seed: int = 1,
        num_shards: int = 1,
        shard_id: int = 0,
        num_workers: int = 0,
        epoch: int = 1,
        batching: Optional[Batching] = None,
    ):
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id {shard_id} is not in [0, {num_shards})")
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.frozen_batches = tuple(np.asarray(b, dtype=np.int64) for b in batch_sampler)
        self.seed = seed
        self.num_shards = num_shards
        self.shard_id = shard_id
        self.num_workers = num_workers
        self.epoch = max(int(epoch), 1)
        self.shuffle = True
        self._cur_epoch_itr: Optional[CountingIterator] = None
        self._next_epoch_itr: Optional[CountingIterator] = None
        self.batching = batching  # how the batches were made (remakes them for a saved sample position)
        self._sampler: Optional[Dict[str, Any]] = None
        self._plan: Optional[EpochPlan] = None  # the epoch's global batch list (None: the shuffled frozen one)

    def __len__(self) -> int:
        """Batches per rank per epoch (dummies included)."""
        return math.ceil(len(self.frozen_batches) / self.num_shards)

    @property
    def first_batch(self) -> Dict[str, Any]:
        """The first batch of the unshuffled list, collated (e.g. to warm up or size memory)."""
        if not self.frozen_batches:
            return {}
        return self.collate_fn([self.dataset[int(i)] for i in self.frozen_batches[0]])

    @property
    def next_epoch_idx(self) -> int:
        """The epoch that the next ``next_epoch_itr()`` returns."""
        if self._next_epoch_itr is not None:
            return self.epoch
        if self._cur_epoch_itr is not None and self.end_of_epoch():
            return self.epoch + 1
        return self.epoch

    def next_epoch_itr(self, shuffle: bool = True) -> CountingIterator:
        """The iterator over this rank's batches of the next epoch (or of the resumed one)."""
        self.epoch = self.next_epoch_idx
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.epoch)
        if self._next_epoch_itr is not None:
            self._cur_epoch_itr, self._next_epoch_itr = self._next_epoch_itr, None
        else:
            self._plan = None  # a new epoch: this run's batching from its start
            self._cur_epoch_itr = self._iterator_for_epoch(self.epoch, shuffle)
            self.shuffle = shuffle
        return self._cur_epoch_itr

    def end_of_epoch(self) -> bool:
        """Whether the current epoch's iterator is exhausted (False before the first epoch starts)."""
        return self._cur_epoch_itr is not None and not self._cur_epoch_itr.has_next()

    @property
    def iterations_in_epoch(self) -> int:
        """Batches of the current epoch consumed so far."""
        if self._cur_epoch_itr is not None:
            return self._cur_epoch_itr.n
        if self._next_epoch_itr is not None:
            return self._next_epoch_itr.n
        return 0

    @property
    def sampler(self) -> Dict[str, Any]:
        """This iterator's batching, as a checkpoint records it (see :mod:`toolkit.data.sample_position`)."""
        if self._sampler is None:
            self._sampler = sampler_state(self.frozen_batches, self.seed, self.batching)
        return self._sampler

    def _epoch_plan(self) -> EpochPlan:
        if self._plan is not None:
            return self._plan
        return EpochPlan(self.epoch_batches(self.epoch, self.shuffle), 0, self.sampler)

    def state_dict(self) -> Dict[str, Any]:
        """The position: batches this rank consumed and (what a resume uses) samples consumed in the epoch."""
        if self.end_of_epoch():
            return {
                "epoch": self.epoch + 1,
                "iterations_in_epoch": 0,
                "shuffle": bool(self.shuffle),
                "samples_in_epoch": 0,
                "sampler": self.sampler,
            }
        n = int(self.iterations_in_epoch)
        plan = self._epoch_plan()
        return {
            "epoch": int(self.epoch),
            "iterations_in_epoch": n,
            "shuffle": bool(self.shuffle),
            "samples_in_epoch": samples_consumed(plan, n, self.num_shards),
            "sampler": plan.origin,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        offset = int(state.get("iterations_in_epoch", 0))
        self.shuffle = bool(state.get("shuffle", True))
        self._cur_epoch_itr = None
        self._plan = None
        if state.get("samples_in_epoch"):  # a sample position (older checkpoints: a batch count)
            offset, self._plan = resume_plan(
                state, self.epoch, self.shuffle, self.frozen_batches, self.sampler, self.batching, self.num_shards
            )
            if self._plan is not None:
                self._next_epoch_itr = self._iterator_for_epoch(self.epoch, self.shuffle)
                return
        if offset > 0:
            if offset >= len(self):
                raise UserError(
                    f"checkpoint: the data position (batch {offset} of epoch {self.epoch}) is past the "
                    f"{len(self)} batches this data and batching give per epoch; the data or --max-tokens/"
                    f"--batch-size/world size changed. Restart the epoch with --reset-dataloader"
                )
            self._next_epoch_itr = self._iterator_for_epoch(self.epoch, self.shuffle, offset=offset)
        else:
            self._next_epoch_itr = None

    # --- internals ------------------------------------------------------------------
    def epoch_batches(self, epoch: int, shuffle: bool = True) -> List[np.ndarray]:
        """All ranks' batches of ``epoch`` in order (before sharding)."""
        batches = list(self.frozen_batches)
        if shuffle:
            np.random.RandomState(self.seed + epoch).shuffle(batches)
        return batches

    def shard_batches(self, epoch: int, shuffle: bool = True) -> List[np.ndarray]:
        """This rank's batches of ``epoch``, the dummy (if any) last."""
        batches = self._plan.batches if self._plan is not None else self.epoch_batches(epoch, shuffle)
        mine = batches[self.shard_id :: self.num_shards]
        if batches and len(mine) < math.ceil(len(batches) / self.num_shards):
            mine.append(batches[0])
        return mine

    def _iterator_for_epoch(self, epoch: int, shuffle: bool, offset: int = 0) -> CountingIterator:
        mine = self.shard_batches(epoch, shuffle)
        total = len(self._plan.batches) if self._plan is not None else len(self.frozen_batches)
        num_real = len(range(self.shard_id, total, self.num_shards))
        loader = _BatchLoader(self.dataset, self.collate_fn, mine, num_real)
        positions = range(offset, len(mine))
        if self.num_workers > 0:
            itr: Iterable = torch.utils.data.DataLoader(
                loader,
                batch_size=None,
                sampler=positions,
                num_workers=self.num_workers,
                pin_memory=torch.cuda.is_available(),
                worker_init_fn=quiet_descriptor_sharing_errors,
            )
        else:
            itr = (loader[k] for k in positions)
        return CountingIterator(itr, start=offset, total=len(mine))


def quiet_descriptor_sharing_errors(worker_id: int) -> None:
    """In a DataLoader worker: the thread that hands batch tensors' file descriptors to the main process
    (``multiprocessing.resource_sharer._serve``) reports a broken connection through ``sys.excepthook`` when
    the main process is already gone, e.g. exiting after another worker was killed, and its half-printed
    traceback would follow the run's one-line error. Those reports are dropped; any other error still prints."""
    original = sys.excepthook

    def hook(kind, value, tb) -> None:
        frames = traceback.extract_tb(tb) if tb is not None else []
        if any(f.filename.endswith(os.path.join("multiprocessing", "resource_sharer.py")) for f in frames):
            return
        original(kind, value, tb)

    sys.excepthook = hook


class GroupedIterator:
    """Groups an iterator's items into lists of ``chunk_size`` (one list per update with --update-freq).

    As fairseq's: ``len`` and ``n`` (groups consumed, which a progress bar uses as its
    resume offset) count groups; the last group may be shorter.
    """

    def __init__(self, iterable: Iterable, chunk_size: int):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.iterable = iterable
        self.chunk_size = chunk_size
        self._itr = iter(iterable)
        self.n = int(math.ceil(getattr(iterable, "n", 0) / float(chunk_size)))
        try:
            size: Optional[int] = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            size = None
        self.total = None if size is None else int(math.ceil(size / float(chunk_size)))

    def __len__(self) -> int:
        if self.total is None:
            raise TypeError("the grouped iterable has no length")
        return self.total

    def __iter__(self) -> GroupedIterator:
        return self

    def __next__(self) -> list:
        chunk = list(itertools.islice(self._itr, self.chunk_size))
        if not chunk:
            raise StopIteration
        self.n += 1
        return chunk

    def has_next(self) -> bool:
        if hasattr(self.iterable, "has_next"):
            return self.iterable.has_next()
        return self.total is None or self.n < self.total
