"""The data position of a checkpoint in *samples*, so a resume with other batching trains exactly the rest.

An epoch's samples are consumed in one order: the epoch's batch list (made by the
batching the epoch *started* with, its "origin"), shuffled with ``seed + epoch``, read
batch after batch (rank ``r`` of ``W`` taking every ``W``-th). Consumed after ``n``
batches per rank: the first ``n * W`` batches, a prefix of that order. The checkpoint
stores the prefix's length in samples and the origin's :func:`sampler_state` (seed, the
batching flags, a fingerprint of the batch list).

On resume (:func:`resume_plan`):

- same batching, and the prefix ends at a batch boundary that divides among the ranks:
  the usual batch offset (bitwise the run that never stopped);
- otherwise (``--batch-size``, ``--max-tokens``, ``--required-batch-size-multiple``,
  ``--seed`` or the number of replicas changed): the origin's order is rebuilt from the
  saved flags, and the samples after the prefix, in that order, are cut into batches
  with this run's flags for the rest of the epoch (one INFO line). Later epochs use this
  run's batching from their start.

What the samples *are* (``--tokens-per-sample``, ``--sample-break-mode``) cannot change in
mid-epoch: the counts would name other samples. That is refused unless
``--reset-dataloader``. Checkpoints without a sample count (batch counts) resume as before.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from toolkit.core.errors import UserError

logger = logging.getLogger(__name__)

BATCH_FLAGS = ("max_tokens", "batch_size", "required_batch_size_multiple")
SAMPLE_FLAGS = ("tokens_per_sample", "sample_break_mode")


@dataclass
class Batching:
    """How a batch list is made from a dataset, so it can be made again with other flags.

    ``ordered(seed)``: the sample indices in the order batches are cut; ``make(indices, flags)``:
    the batches of those indices (in order) under ``flags`` (:data:`BATCH_FLAGS`); ``flags``: this
    run's; ``samples``: what the samples are (:data:`SAMPLE_FLAGS`).
    """

    ordered: Callable[[int], np.ndarray]
    make: Callable[[np.ndarray, Dict[str, Any]], List[np.ndarray]]
    flags: Dict[str, Any]
    samples: Dict[str, Any] = field(default_factory=dict)


@dataclass
class EpochPlan:
    """The global batch list an epoch's iterator reads, and the samples consumed before its first batch."""

    batches: List[np.ndarray]
    base_samples: int = 0
    origin: Optional[Dict[str, Any]] = None  # the sampler state of the batching the epoch started with


def fingerprint(batches) -> str:
    """A short hash of a batch list (its indices and where batches end)."""
    h = hashlib.sha1()
    for b in batches:
        h.update(np.asarray(b, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def sampler_state(batches, seed: int, batching: Optional[Batching]) -> Dict[str, Any]:
    return {
        "seed": int(seed),
        "num_batches": len(batches),
        "num_samples": int(sum(len(b) for b in batches)),
        "fingerprint": fingerprint(batches),
        **(dict(batching.flags) if batching else {}),
        **(dict(batching.samples) if batching else {}),
    }


def shuffled(batches, seed: int, epoch: int, shuffle: bool) -> List[np.ndarray]:
    """The epoch's batch order (fairseq's: the list shuffled with ``RandomState(seed + epoch)``)."""
    batches = list(batches)
    if shuffle:
        np.random.RandomState(seed + epoch).shuffle(batches)
    return batches


def samples_consumed(plan: EpochPlan, batches_per_rank: int, num_shards: int) -> int:
    return plan.base_samples + int(sum(len(b) for b in plan.batches[: batches_per_rank * num_shards]))


def check_same_samples(saved: Dict[str, Any], batching: Optional[Batching]) -> None:
    """--tokens-per-sample / --sample-break-mode changed in mid-epoch: one UserError."""
    for key in SAMPLE_FLAGS:
        ours = (batching.samples if batching else {}).get(key)
        if key in saved and ours is not None and saved[key] != ours:
            flag = "--" + key.replace("_", "-")
            raise UserError(
                f"{flag} {ours}: the checkpoint stopped in mid-epoch with {flag} {saved[key]}, and its "
                f"data position counts those samples; resume with {flag} {saved[key]}, or add "
                f"--reset-dataloader to start the epoch over with the new samples"
            )


def _origin_batches(saved: Dict[str, Any], own_batches, own: Dict[str, Any], batching: Optional[Batching]):
    """The batch list the saved epoch started with (before its shuffle)."""
    if saved.get("fingerprint") == own["fingerprint"]:
        return own_batches
    if batching is not None and all(k in saved for k in BATCH_FLAGS):
        rebuilt = batching.make(batching.ordered(int(saved["seed"])), {k: saved[k] for k in BATCH_FLAGS})
        if fingerprint(rebuilt) == saved.get("fingerprint"):
            return rebuilt
    raise UserError(
        f"checkpoint: its data position (epoch in progress, {saved.get('num_samples')} samples in "
        f"{saved.get('num_batches')} batches) does not match this data: the data-bin changed. Add "
        f"--reset-dataloader to start the epoch over"
    )


def _boundary(batches, samples: int) -> Optional[int]:
    """k such that the first k batches hold exactly ``samples`` samples (None: inside a batch)."""
    total = 0
    for k, b in enumerate(batches):
        if total == samples:
            return k
        total += len(b)
    return len(batches) if total == samples else None


def resume_plan(
    saved_state: Dict[str, Any],
    epoch: int,
    shuffle: bool,
    own_batches,
    own: Dict[str, Any],
    batching: Optional[Batching],
    num_shards: int,
):
    """``(batch offset per rank, None)`` when the usual offset resumes exactly, else ``(0, EpochPlan)``."""
    saved, consumed = saved_state.get("sampler") or {}, int(saved_state["samples_in_epoch"])
    check_same_samples(saved, batching)
    origin = _origin_batches(saved, own_batches, own, batching)
    order = shuffled(origin, int(saved.get("seed", own["seed"])), epoch, shuffle)
    k = _boundary(order, consumed)
    same = origin is own_batches and saved.get("seed", own["seed"]) == own["seed"]
    if same and k is not None and k % num_shards == 0:
        return k // num_shards, None
    rest = np.concatenate(order)[consumed:] if order else np.zeros(0, dtype=np.int64)
    if same and k is not None:
        batches = order[k:]
    else:
        batches = batching.make(rest, dict(batching.flags)) if batching else order[k:]
    changed = [
        f"--{key.replace('_', '-')} {saved.get(key)} -> {own.get(key)}"
        for key in (*BATCH_FLAGS, "seed")
        if saved.get(key) != own.get(key)
    ]
    logger.info(
        f"data position: {consumed} of the {sum(len(b) for b in order)} samples of epoch {epoch} consumed; "
        f"the batching changed ({', '.join(changed) or f'{num_shards} replicas'}), so the remaining "
        f"{len(rest)} samples, in the order they had, are trained in {len(batches)} new batches"
    )
    return 0, EpochPlan(batches, consumed, saved)
