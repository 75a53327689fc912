"""``--lr-scheduler reduce_lr_on_plateau``: optional linear warmup, then shrink the lr when validation stalls.

As fairseq's (which drives ``torch.optim.lr_scheduler.ReduceLROnPlateau``):

* warmup (``--warmup-updates N > 0``): ``lr = warmup_init_lr + n * (lr - warmup_init_lr) / N`` for
  updates ``n <= N`` (``--warmup-init-lr`` defaults to 0 with a warmup, else ``--lr``);
* after the warmup, at the end of each epoch with a validation loss: the loss improves on the best
  when it is below ``best * (1 - --lr-threshold)`` (above ``best * (1 + threshold)`` with
  ``--maximize-best-checkpoint-metric``); after more than ``--lr-patience`` epochs in a row without
  improvement the lr is multiplied by ``--lr-shrink`` and the count restarts. During the warmup
  epoch ends are only counted.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from toolkit.core.errors import UserError
from toolkit.optim.lr_scheduler import LRScheduler
from toolkit.core.registry import register_lr_scheduler
from toolkit.config.components import ReduceLROnPlateauLRScheduleConfig  # noqa: F401  (its options, torch-free for --help)


@register_lr_scheduler("reduce_lr_on_plateau", dataclass=ReduceLROnPlateauLRScheduleConfig)
class ReduceLROnPlateauLRSchedule(LRScheduler):
    def __init__(self, cfg: ReduceLROnPlateauLRScheduleConfig, optimizer: torch.optim.Optimizer):
        super().__init__(cfg, optimizer)
        if not 0.0 < cfg.lr_shrink < 1.0:
            raise UserError(f"--lr-shrink: must be in (0, 1) for reduce_lr_on_plateau, got {cfg.lr_shrink}")
        if cfg.warmup_updates < 0 or cfg.lr_patience < 0:
            raise UserError("--warmup-updates and --lr-patience: must be >= 0")
        self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer,
            mode="max" if cfg.maximize_best_checkpoint_metric else "min",
            factor=cfg.lr_shrink,
            patience=cfg.lr_patience,
            threshold=cfg.lr_threshold,
        )
        self.warmup_updates = cfg.warmup_updates
        self.warmup_init_lr = cfg.warmup_init_lr
        if self.warmup_init_lr < 0:
            self.warmup_init_lr = 0.0 if self.warmup_updates > 0 else cfg.lr
        self.lr_step = (cfg.lr - self.warmup_init_lr) / self.warmup_updates if self.warmup_updates > 0 else 0.0
        self.warmup_end = self.warmup_updates <= 0
        self.set_lr(cfg.lr if self.warmup_end else self.warmup_init_lr)

    def step(self, epoch: int, val_loss: Optional[float] = None) -> float:
        if val_loss is not None and self.warmup_end:
            self.plateau.step(val_loss)
        else:
            self.plateau.last_epoch = epoch
        return self.get_lr()

    def step_update(self, num_updates: int) -> float:
        if self.warmup_updates > 0:
            if num_updates <= self.warmup_updates:
                self.set_lr(self.warmup_init_lr + num_updates * self.lr_step)
            else:
                self.warmup_end = True
        return self.get_lr()

    def state_dict(self) -> Dict[str, Any]:
        return {"best": self.plateau.best, "last_epoch": self.plateau.last_epoch}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.plateau.best = state_dict["best"]
        if "last_epoch" in state_dict:
            self.plateau.last_epoch = state_dict["last_epoch"]
