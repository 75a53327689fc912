"""``--lr-scheduler polynomial_decay``: linear warmup, then polynomial decay to ``--end-learning-rate``."""

from __future__ import annotations


import torch

from toolkit.core.errors import UserError
from toolkit.optim.lr_scheduler import LRScheduler
from toolkit.core.registry import register_lr_scheduler
from toolkit.config.components import PolynomialDecayLRScheduleConfig  # noqa: F401  (its options, torch-free for --help)


@register_lr_scheduler("polynomial_decay", dataclass=PolynomialDecayLRScheduleConfig)
class PolynomialDecayLRSchedule(LRScheduler):
    """Warmup: ``lr * num_updates / warmup_updates``; then
    ``(lr - end) * (1 - (n - warmup) / (total - warmup)) ** power + end``; ``end`` from ``total`` on."""

    def __init__(self, cfg: PolynomialDecayLRScheduleConfig, optimizer: torch.optim.Optimizer):
        super().__init__(cfg, optimizer)
        total = (
            cfg.total_num_update if cfg.total_num_update is not None and cfg.total_num_update > 0 else cfg.max_update
        )
        if not total or total <= 0:
            raise UserError(
                "--total-num-update: polynomial_decay needs the number of updates to decay over; "
                "set --total-num-update N (or --max-update N)"
            )
        if cfg.warmup_updates < 0:
            raise UserError(f"--warmup-updates: must be >= 0, got {cfg.warmup_updates}")
        self.warmup_updates = cfg.warmup_updates or 0
        self.lr = cfg.lr
        self.warmup_factor = 1.0 / self.warmup_updates if self.warmup_updates > 0 else 1.0
        self.end_learning_rate = cfg.end_learning_rate
        self.total_num_update = total
        self.power = cfg.power
        self.set_lr(self.warmup_factor * self.lr)

    def get_next_lr(self, epoch: int) -> float:
        if self.cfg.force_anneal is None or epoch < self.cfg.force_anneal:
            return self.cfg.lr
        # as fairseq: from --force-anneal on, the current learning rate becomes the base
        return self.get_lr()

    def step_begin_epoch(self, epoch: int) -> float:
        self.lr = self.get_next_lr(epoch)
        self.set_lr(self.warmup_factor * self.lr)
        return self.get_lr()

    def step_update(self, num_updates: int) -> float:
        warmup = self.warmup_updates
        if warmup > 0 and num_updates <= warmup:
            self.warmup_factor = num_updates / float(warmup)
            lr = self.warmup_factor * self.lr
        elif num_updates >= self.total_num_update:
            lr = self.end_learning_rate
        else:
            lr_range = self.lr - self.end_learning_rate
            pct_remaining = 1 - (num_updates - warmup) / (self.total_num_update - warmup)
            lr = lr_range * pct_remaining**self.power + self.end_learning_rate
        self.set_lr(lr)
        return self.get_lr()
