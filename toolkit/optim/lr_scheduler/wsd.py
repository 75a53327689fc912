"""``--lr-scheduler wsd``: warmup-stable-decay (MiniCPM, https://arxiv.org/abs/2404.06395; Hägele et al.,
https://arxiv.org/abs/2405.18392): linear warmup to ``--lr``, hold it, then decay to ``--min-lr`` over the last
updates.

The stable phase needs no end in sight: a run trained at the constant rate can be resumed from any of its
checkpoints with a new ``--max-update`` and ``--wsd-decay-start N`` (usually the checkpoint's update), and the decay
runs from update N to the new end. The learning rate is a function of the update number and the flags alone, so a
resume mid-decay with the same flags continues with exactly the rates of an uninterrupted run.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, Tuple

import torch

from toolkit.core.errors import UserError
from toolkit.optim.lr_scheduler import LRScheduler
from toolkit.core.registry import register_lr_scheduler
from toolkit.config.components import WSDLRScheduleConfig  # noqa: F401  (its options, torch-free for --help)

logger = logging.getLogger(__name__)

DECAY_SHAPES = {
    # share of (lr - min_lr) left after the fraction ``t`` in [0, 1] of the decay
    "linear": lambda t: 1.0 - t,
    "cosine": lambda t: 0.5 * (1.0 + math.cos(math.pi * t)),
    "1-sqrt": lambda t: 1.0 - math.sqrt(t),
}


def _decay_window(cfg: WSDLRScheduleConfig) -> Tuple[int, int]:
    """(first update of the decay, update where it reaches --min-lr), checked against the warmup."""
    total = cfg.total_num_update if cfg.total_num_update is not None and cfg.total_num_update > 0 else cfg.max_update
    if not total or total <= 0:
        raise UserError(
            "--max-update: wsd decays over the last updates of the run; set --max-update N (or --total-num-update N)"
        )
    if not 0.0 <= cfg.decay_fraction <= 1.0:
        raise UserError(f"--decay-fraction: a share of the run in [0, 1], got {cfg.decay_fraction:g}")
    start = cfg.wsd_decay_start if cfg.wsd_decay_start is not None else total - round(cfg.decay_fraction * total)
    if not cfg.warmup_updates <= start <= total:
        raise UserError(
            f"--wsd-decay-start: the decay must start after the warmup and by the end of the run "
            f"(--warmup-updates {cfg.warmup_updates} <= start <= {total}), got {start}"
        )
    return start, total


@register_lr_scheduler("wsd", dataclass=WSDLRScheduleConfig)
class WSDLRSchedule(LRScheduler):
    """At update ``n``: ``lr * n / warmup`` during the warmup; ``lr`` until ``start``; then
    ``min_lr + (lr - min_lr) * shape((n - start) / (end - start))``; ``min_lr`` from ``end`` on. With no decay
    (``--decay-fraction 0``) the rate stays ``lr`` to the end: a stable phase to resume later with a decay."""

    def __init__(self, cfg: WSDLRScheduleConfig, optimizer: torch.optim.Optimizer):
        super().__init__(cfg, optimizer)
        if cfg.warmup_updates < 0:
            raise UserError(f"--warmup-updates: must be >= 0, got {cfg.warmup_updates}")
        if not 0.0 <= cfg.min_lr <= cfg.lr:
            raise UserError(f"--min-lr: must be in [0, --lr] for wsd (--lr {cfg.lr}, --min-lr {cfg.min_lr})")
        self.peak_lr, self.min_lr = cfg.lr, cfg.min_lr
        self.warmup_updates = cfg.warmup_updates
        self.decay_start, self.decay_end = _decay_window(cfg)
        self.shape = DECAY_SHAPES[cfg.decay_shape]
        self.num_updates = 0
        self.set_lr(self.peak_lr if self.warmup_updates == 0 else 0.0)

    def lr_at(self, num_updates: int) -> float:
        if num_updates < self.warmup_updates:
            return self.peak_lr * num_updates / self.warmup_updates
        if num_updates < self.decay_start or self.decay_start == self.decay_end:  # no decay: a stable-only run
            return self.peak_lr
        if num_updates >= self.decay_end:
            return self.min_lr
        progress = (num_updates - self.decay_start) / (self.decay_end - self.decay_start)
        return self.min_lr + (self.peak_lr - self.min_lr) * self.shape(progress)

    def step_update(self, num_updates: int) -> float:
        self.num_updates = num_updates
        lr = self.lr_at(num_updates)
        self.set_lr(lr)
        return lr

    def state_dict(self) -> Dict[str, Any]:
        return {
            **super().state_dict(),
            "num_updates": self.num_updates,
            "decay_start": self.decay_start,
            "decay_end": self.decay_end,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Warns when a checkpoint taken inside its decay is resumed with another decay window: the learning rate
        jumps (resuming a stable-phase checkpoint with a new window is the intended use and stays quiet)."""
        super().load_state_dict(state_dict)
        saved = (state_dict.get("decay_start"), state_dict.get("decay_end"))
        at = state_dict.get("num_updates", 0)
        if None not in saved and saved[0] < at and saved[0] < saved[1] and saved != (self.decay_start, self.decay_end):
            logger.warning(
                "--wsd-decay-start: the checkpoint at update %d was decaying over updates %d..%d; "
                "the flags now decay over %d..%d, so the learning rate jumps from %g to %g",
                at,
                saved[0],
                saved[1],
                self.decay_start,
                self.decay_end,
                _saved_rate(self, saved, at),
                self.lr_at(at),
            )


def _saved_rate(schedule: WSDLRSchedule, window: Tuple[int, int], num_updates: int) -> float:
    """The rate the checkpoint's own decay window gave at ``num_updates``."""
    progress = min(1.0, (num_updates - window[0]) / (window[1] - window[0]))
    return schedule.min_lr + (schedule.peak_lr - schedule.min_lr) * schedule.shape(progress)
