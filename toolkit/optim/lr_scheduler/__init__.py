"""Learning-rate schedulers with fairseq's API, driving a plain ``torch.optim.Optimizer``.

The trainer calls, as fairseq's does::

    lr_scheduler.step_begin_epoch(epoch)        # at the start of each epoch (epochs start at 1)
    lr_scheduler.step_update(num_updates)       # once before training (0) and after every update
    lr_scheduler.step(epoch, val_loss)          # at the end of each epoch

Each scheduler sets ``param_group["lr"]`` of every group of the optimizer.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from toolkit.core.registry import LR_SCHEDULER_REGISTRY


class LRScheduler:
    """Base class: keeps the best validation loss; subclasses set the learning rate."""

    def __init__(self, cfg: Any, optimizer: torch.optim.Optimizer):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError("optimizer must be a torch.optim.Optimizer")
        self.cfg = cfg
        self.optimizer = optimizer
        self.best: Optional[float] = None

    # -- the optimizer's learning rate ---------------------------------------
    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def get_lr(self) -> float:
        lr = self.optimizer.param_groups[0]["lr"]
        return float(lr)

    # -- fairseq's hooks -----------------------------------------------------
    def step_begin_epoch(self, epoch: int) -> Optional[float]:
        """Update the learning rate at the beginning of the given epoch."""
        return None

    def step(self, epoch: int, val_loss: Optional[float] = None) -> float:
        """Update the learning rate at the end of the given epoch (records the best ``val_loss``)."""
        if val_loss is not None:
            self.best = val_loss if self.best is None else min(self.best, val_loss)
        return self.get_lr()

    def step_update(self, num_updates: int) -> float:
        """Update the learning rate after each update."""
        return self.get_lr()

    def state_dict(self) -> Dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.best = state_dict.get("best", self.best)


def build_lr_scheduler_from_section(name: str, section: Any, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """The registered scheduler ``name`` with its own options ``section``, driving ``optimizer``."""
    from toolkit.core.registry import import_submodules

    import_submodules(__name__)
    return LR_SCHEDULER_REGISTRY.get(name).cls(section, optimizer)


def build_lr_scheduler(values: Any, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """Build ``values["lr_scheduler"]`` from a flat dict (or namespace) of options, e.g. in tests."""
    from toolkit.config.options import config_from_args
    from toolkit.core.registry import import_submodules

    import_submodules(__name__)
    values = values if isinstance(values, dict) else vars(values)
    name = values.get("lr_scheduler") or LR_SCHEDULER_REGISTRY.default
    entry = LR_SCHEDULER_REGISTRY.get(name)
    section = config_from_args(entry.config, values) if entry.config is not None else None
    return build_lr_scheduler_from_section(name, section, optimizer)
