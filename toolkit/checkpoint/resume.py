"""Restarting a finished run does nothing: the stop criteria are checked right after the load.

The training loop checks ``--max-update`` and the others only after a step, so without
this a run restarted at update N = ``--max-update`` would train update N+1 and overwrite
its checkpoints; every restart would add one more. Checking once after loading, before
any step, makes restarts idempotent (a job scheduler may rerun a finished job), while a
raised ``--max-update`` continues exactly where the checkpoint stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class StopCriteria:
    """The flags that end a run (fairseq's); non-positive (or negative min-lr) means "not set"."""

    max_update: int = 0
    max_epoch: int = 0
    stop_time_hours: float = 0.0
    stop_min_lr: float = -1.0

    @classmethod
    def from_config(cls, opt) -> StopCriteria:
        """From the ``OptimizationConfig`` section."""
        return cls(
            max_update=opt.max_update,
            max_epoch=opt.max_epoch,
            stop_time_hours=opt.stop_time_hours,
            stop_min_lr=opt.stop_min_lr,
        )


def finished_reason(
    checkpoint: str, criteria: StopCriteria, num_updates: int, next_epoch: int, lr: float, training_hours: float = 0.0
) -> Optional[str]:
    """The ``| done: ...`` line when the loaded checkpoint already meets a stop criterion, else None.

    ``next_epoch`` is the epoch the loop would start (or continue) next; ``training_hours``
    the training time that counts against ``--stop-time-hours``.
    """
    what = f"| done: {checkpoint}"
    if criteria.max_update > 0 and num_updates >= criteria.max_update:
        return f"{what} is at update {num_updates} >= --max-update {criteria.max_update}; nothing to do"
    if criteria.max_epoch > 0 and next_epoch > criteria.max_epoch:
        return f"{what} finished epoch {next_epoch - 1} >= --max-epoch {criteria.max_epoch}; nothing to do"
    if criteria.stop_time_hours > 0 and training_hours > criteria.stop_time_hours:
        return (
            f"{what} trained {training_hours:.4f} hours > --stop-time-hours {criteria.stop_time_hours}; nothing to do"
        )
    if criteria.stop_min_lr >= 0 and lr <= criteria.stop_min_lr:
        return f"{what} has lr {lr} <= --stop-min-lr {criteria.stop_min_lr}; nothing to do"
    return None
