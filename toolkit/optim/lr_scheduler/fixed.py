"""``--lr-scheduler fixed``: a constant learning rate, optional linear warmup and annealing by epoch."""

from __future__ import annotations

from typing import Any, Dict

import torch

from toolkit.core.errors import UserError
from toolkit.optim.lr_scheduler import LRScheduler
from toolkit.core.registry import register_lr_scheduler
from toolkit.config.components import FixedLRScheduleConfig  # noqa: F401  (its options, torch-free for --help)


@register_lr_scheduler("fixed", dataclass=FixedLRScheduleConfig)
class FixedLRSchedule(LRScheduler):
    """lr = ``--lr`` (times ``(num_updates + 1) / warmup_updates`` during warmup); from epoch
    ``--force-anneal`` on, lr = ``--lr * lr_shrink ** (epoch + 1 - force_anneal)``.

    ``--lr 0.1,0.05`` (fairseq's list form): epoch e uses the e-th value, the last one repeats, and
    annealing starts from the last one."""

    def __init__(self, cfg: FixedLRScheduleConfig, optimizer: torch.optim.Optimizer):
        super().__init__(cfg, optimizer)
        if cfg.warmup_updates < 0:
            raise UserError(f"--warmup-updates: must be >= 0, got {cfg.warmup_updates}")
        self.warmup_updates = cfg.warmup_updates or 0
        self.lr = cfg.lr
        self.warmup_factor = 1.0 / self.warmup_updates if self.warmup_updates > 0 else 1.0
        self.set_lr(self.warmup_factor * self.lr)

    def state_dict(self) -> Dict[str, Any]:
        return {"lr": self.lr, "best": self.best}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if "lr" in state_dict:
            self.lr = state_dict["lr"]

    def get_next_lr(self, epoch: int) -> float:
        force_anneal, lrs = self.cfg.force_anneal, tuple(self.cfg.lr_per_epoch) or (self.cfg.lr,)
        if force_anneal is None or epoch < force_anneal:
            return lrs[min(max(epoch, 1), len(lrs)) - 1]
        return lrs[-1] * self.cfg.lr_shrink ** (epoch + 1 - force_anneal)

    def step_begin_epoch(self, epoch: int) -> float:
        self.lr = self.get_next_lr(epoch)
        self.set_lr(self.warmup_factor * self.lr)
        return self.get_lr()

    def step_update(self, num_updates: int) -> float:
        if self.warmup_updates > 0 and num_updates < self.warmup_updates:
            self.warmup_factor = (num_updates + 1) / float(self.warmup_updates)
            self.set_lr(self.warmup_factor * self.lr)
        else:
            self.set_lr(self.lr)
        return self.get_lr()
