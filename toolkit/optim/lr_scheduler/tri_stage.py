"""``--lr-scheduler tri_stage``: fairseq's three stages (https://arxiv.org/abs/1904.08779, SpecAugment):
linear warmup from ``--init-lr-scale`` x lr to lr, hold at lr, exponential decay to ``--final-lr-scale`` x lr."""

from __future__ import annotations

import math
from typing import Tuple

import torch

from toolkit.config.flag_types import as_tuple
from toolkit.core.errors import UserError
from toolkit.optim.lr_scheduler import LRScheduler
from toolkit.core.registry import register_lr_scheduler
from toolkit.config.components import TriStageLRScheduleConfig  # noqa: F401  (its options, torch-free for --help)


def _stage_lengths(cfg: TriStageLRScheduleConfig) -> Tuple[int, int, int]:
    """(warmup, hold, decay) updates: from ``--phase-ratio`` x ``--max-update`` (truncated, as fairseq) or given."""
    if cfg.phase_ratio is None:
        steps = (cfg.warmup_steps, cfg.hold_steps, cfg.decay_steps)
        if min(steps) < 0:
            raise UserError(f"--warmup-steps/--hold-steps/--decay-steps: must be >= 0, got {steps}")
        return steps
    ratios = as_tuple(cfg.phase_ratio)
    if len(ratios) != 3 or min(ratios) < 0 or not math.isclose(sum(ratios), 1.0, abs_tol=1e-9):
        raise UserError(
            f"--phase-ratio: needs three non-negative shares adding up to 1 (warmup,hold,decay), "
            f"got {','.join(f'{r:g}' for r in ratios)}"
        )
    if not cfg.max_update or cfg.max_update <= 0:
        raise UserError("--phase-ratio: the shares are of --max-update; set --max-update N")
    warmup, hold, decay = (int(cfg.max_update * r) for r in ratios)
    return warmup, hold, decay


@register_lr_scheduler("tri_stage", dataclass=TriStageLRScheduleConfig)
class TriStageLRSchedule(LRScheduler):
    """fairseq's ``tri_stage`` at every update ``n`` (stage bounds as fairseq's ``_decide_stage``):

    - ``n < warmup``: ``init + n * (lr - init) / warmup`` with ``init = init_lr_scale * lr``;
    - ``n < warmup + hold``: ``lr``;
    - ``n <= warmup + hold + decay``: ``lr * exp(log(final_lr_scale) * (n - warmup - hold) / decay)``;
    - after that: ``final_lr_scale * lr``.

    The epoch hooks leave the learning rate alone."""

    def __init__(self, cfg: TriStageLRScheduleConfig, optimizer: torch.optim.Optimizer):
        super().__init__(cfg, optimizer)
        if cfg.init_lr_scale < 0:
            raise UserError(f"--init-lr-scale: must be >= 0, got {cfg.init_lr_scale}")
        if cfg.final_lr_scale <= 0:
            raise UserError(
                f"--final-lr-scale: the decay is exponential, so the final scale must be > 0 "
                f"(e.g. 0.01), got {cfg.final_lr_scale}"
            )
        self.warmup_steps, self.hold_steps, self.decay_steps = _stage_lengths(cfg)
        if self.decay_steps <= 0:
            raise UserError(
                "--decay-steps: tri_stage needs a decay stage of at least one update; set "
                "--decay-steps N (or --phase-ratio W,H,D with --max-update large enough for D)"
            )
        self.peak_lr = cfg.lr
        self.init_lr = cfg.init_lr_scale * cfg.lr
        self.final_lr = cfg.final_lr_scale * cfg.lr
        self.warmup_rate = (self.peak_lr - self.init_lr) / self.warmup_steps if self.warmup_steps else 0.0
        self.decay_factor = -math.log(cfg.final_lr_scale) / self.decay_steps
        self.set_lr(self.init_lr)

    def step_update(self, num_updates: int) -> float:
        hold_start = self.warmup_steps
        decay_start = hold_start + self.hold_steps
        if num_updates < hold_start:
            lr = self.init_lr + self.warmup_rate * num_updates
        elif num_updates < decay_start:
            lr = self.peak_lr
        elif num_updates <= decay_start + self.decay_steps:
            lr = self.peak_lr * math.exp(-self.decay_factor * (num_updates - decay_start))
        else:
            lr = self.final_lr
        self.set_lr(lr)
        return lr
