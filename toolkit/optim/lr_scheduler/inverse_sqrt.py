"""``--lr-scheduler inverse_sqrt``: linear warmup, then decay with the inverse square root of the update."""

from __future__ import annotations


import torch

from toolkit.core.errors import UserError
from toolkit.optim.lr_scheduler import LRScheduler
from toolkit.core.registry import register_lr_scheduler
from toolkit.config.components import InverseSquareRootLRScheduleConfig  # noqa: F401  (its options, torch-free for --help)


@register_lr_scheduler("inverse_sqrt", dataclass=InverseSquareRootLRScheduleConfig)
class InverseSquareRootSchedule(LRScheduler):
    """During warmup ``lr = warmup_init_lr + num_updates * (lr - warmup_init_lr) / warmup_updates``;
    after it ``lr = --lr * sqrt(warmup_updates) / sqrt(num_updates)``."""

    def __init__(self, cfg: InverseSquareRootLRScheduleConfig, optimizer: torch.optim.Optimizer):
        super().__init__(cfg, optimizer)
        if cfg.warmup_updates <= 0:
            # fairseq would divide by zero (or decay from lr 0): the decay is anchored at the warmup's end.
            raise UserError(
                f"--warmup-updates: inverse_sqrt needs at least 1 warmup update "
                f"(its decay is lr * sqrt(warmup_updates / num_updates)), got {cfg.warmup_updates}"
            )
        warmup_end_lr = cfg.lr
        self.warmup_updates = cfg.warmup_updates
        self.warmup_init_lr = cfg.warmup_init_lr if cfg.warmup_init_lr >= 0 else 0.0
        self.lr_step = (warmup_end_lr - self.warmup_init_lr) / self.warmup_updates
        self.decay_factor = warmup_end_lr * self.warmup_updates**0.5
        self.lr = self.warmup_init_lr
        self.set_lr(self.lr)

    def step_update(self, num_updates: int) -> float:
        if num_updates < self.warmup_updates:
            self.lr = self.warmup_init_lr + num_updates * self.lr_step
        else:
            self.lr = self.decay_factor * num_updates**-0.5
        self.set_lr(self.lr)
        return self.lr
