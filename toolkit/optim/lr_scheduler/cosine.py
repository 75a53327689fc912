"""``--lr-scheduler cosine``: linear warmup, then cosine cycles (SGDR, https://arxiv.org/abs/1608.03983)."""

from __future__ import annotations

import math

import torch

from toolkit.core.errors import UserError
from toolkit.optim.lr_scheduler import LRScheduler
from toolkit.core.registry import register_lr_scheduler
from toolkit.config.components import CosineLRScheduleConfig  # noqa: F401  (its options, torch-free for --help)


@register_lr_scheduler("cosine", dataclass=CosineLRScheduleConfig)
class CosineLRSchedule(LRScheduler):
    """Warmup: ``warmup_init_lr + n * (lr - warmup_init_lr) / warmup_updates``; then, within period ``i``
    (length ``period * t_mult**i``, peak and minimum shrunk by ``lr_shrink**i``)
    ``lr = min_lr + 0.5 * (max_lr - min_lr) * (1 + cos(pi * t_curr / t_i))``."""

    def __init__(self, cfg: CosineLRScheduleConfig, optimizer: torch.optim.Optimizer):
        super().__init__(cfg, optimizer)
        self.max_lr = cfg.lr
        if not self.max_lr > cfg.min_lr:
            raise UserError(
                f"--min-lr: must be below --lr for the cosine schedule (--lr {cfg.lr}, --min-lr {cfg.min_lr})"
            )
        if cfg.warmup_updates < 0:
            raise UserError(f"--warmup-updates: must be >= 0, got {cfg.warmup_updates}")
        if cfg.t_mult <= 0:
            raise UserError(f"--t-mult: must be positive, got {cfg.t_mult}")
        self.min_lr = cfg.min_lr
        self.warmup_updates = cfg.warmup_updates
        self.warmup_init_lr = cfg.warmup_init_lr if cfg.warmup_init_lr >= 0 else cfg.min_lr
        self.t_mult = cfg.t_mult
        self.lr_shrink = cfg.lr_shrink
        self.period = cfg.lr_period_updates
        if self.period <= 0:
            if not cfg.max_update or cfg.max_update <= 0:
                raise UserError(
                    "--lr-period-updates: the cosine schedule needs a period; "
                    "set --max-update N or --lr-period-updates N"
                )
            self.period = cfg.max_update - cfg.warmup_updates
            if self.period <= 0:
                raise UserError(
                    f"--warmup-updates: must be below --max-update for the cosine schedule "
                    f"(--warmup-updates {cfg.warmup_updates}, --max-update {cfg.max_update}), "
                    "or set --lr-period-updates"
                )
        if self.warmup_updates > 0:
            self.lr_step = (self.max_lr - self.warmup_init_lr) / self.warmup_updates
        else:
            self.lr_step = 1.0
        self.lr = self.warmup_init_lr
        self.set_lr(self.lr)

    def step_update(self, num_updates: int) -> float:
        if num_updates < self.warmup_updates:
            self.lr = self.warmup_init_lr + num_updates * self.lr_step
        else:
            curr_updates = num_updates - self.warmup_updates
            if self.t_mult != 1:
                i = math.floor(math.log(1 - curr_updates / self.period * (1 - self.t_mult), self.t_mult))
                t_i = self.t_mult**i * self.period
                t_curr = curr_updates - (1 - self.t_mult**i) / (1 - self.t_mult) * self.period
            else:
                i = math.floor(curr_updates / self.period)
                t_i = self.period
                t_curr = curr_updates - self.period * i
            shrink = self.lr_shrink**i
            min_lr = self.min_lr * shrink
            max_lr = self.max_lr * shrink
            self.lr = min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * t_curr / t_i))
        self.set_lr(self.lr)
        return self.lr
