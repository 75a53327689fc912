"""Weights & Biases logging (fairseq's ``--wandb-project``): the scalars TensorBoard gets, through ``wandb``.

Used like ``TensorboardProgressBarWrapper`` (toolkit/logging/progress_bar.py): it wraps a progress
bar, and every ``log``/``print`` also sends the numeric stats, as ``<tag>/<name>`` at the update
number, to one run (rank 0 only). The run is named after ``$WANDB_NAME`` or the save dir, as in
fairseq. ``WANDB_MODE=offline`` writes the run under ``wandb/`` without a network.

``toolkit.train.train_loop`` wraps every training and validation progress bar with :func:`wrap_with_wandb`
when ``--wandb-project`` is given (on the master rank), and calls :func:`finish` at the end.
"""

from __future__ import annotations

import logging
import os
import sys
from numbers import Number
from typing import Any, Dict, Optional

import torch

from toolkit.logging.meters import AverageMeter
from toolkit.logging.progress_bar import BaseProgressBar

logger = logging.getLogger(__name__)


def numeric_stats(stats: Dict[str, Any]) -> Dict[str, float]:
    """The values TensorBoard gets: numbers, meters by their latest value, 1-element tensors; no bools."""
    out: Dict[str, float] = {}
    for key, value in stats.items():
        if key == "num_updates":
            continue
        if isinstance(value, AverageMeter):
            value = value.val
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, Number) and not isinstance(value, bool):
            out[key] = value
    return out


def _import_wandb():
    try:
        import wandb
    except ImportError:
        return None
    return wandb


class WandbProgressBarWrapper(BaseProgressBar):
    """Also logs the numeric stats to W&B project ``project`` (one run per process)."""

    def __init__(self, wrapped_bar: BaseProgressBar, project: str, run_name: Optional[str] = None):
        self.wrapped_bar = wrapped_bar
        self._wandb = _import_wandb()
        if self._wandb is None:
            logger.warning("wandb not found, please install with: pip install wandb")
            return
        if self._wandb.run is None:  # one run for every bar of the process (train, valid, ...)
            self._wandb.init(
                project=project, name=os.environ.get("WANDB_NAME", run_name), config={"argv": " ".join(sys.argv)}
            )

    def __getattr__(self, name):  # epoch, prefix, n, ... of the wrapped bar
        if name == "wrapped_bar":
            raise AttributeError(name)
        return getattr(self.wrapped_bar, name)

    def __len__(self):
        return len(self.wrapped_bar)

    def __iter__(self):
        return iter(self.wrapped_bar)

    def __exit__(self, *exc):
        return self.wrapped_bar.__exit__(*exc)

    def log(self, stats, tag=None, step=None):
        self._log_to_wandb(stats, tag, step)
        self.wrapped_bar.log(stats, tag=tag, step=step)

    def print(self, stats, tag=None, step=None):
        self._log_to_wandb(stats, tag, step)
        self.wrapped_bar.print(stats, tag=tag, step=step)

    def update_config(self, config):
        if self._wandb is not None and self._wandb.run is not None:
            self._wandb.config.update(config, allow_val_change=True)
        self.wrapped_bar.update_config(config)

    def _log_to_wandb(self, stats, tag=None, step=None):
        if self._wandb is None:
            return
        if step is None:
            step = stats["num_updates"]
        prefix = "" if tag is None else tag + "/"
        self._wandb.log({prefix + key: value for key, value in numeric_stats(stats).items()}, step=step)


def wrap_with_wandb(bar: BaseProgressBar, project: Optional[str], run_name: Optional[str] = None) -> BaseProgressBar:
    """``bar`` wrapped when a project is given (pass None off rank 0), else ``bar`` itself."""
    return WandbProgressBarWrapper(bar, project, run_name) if project else bar


def finish() -> None:
    """Close the run (flushes an offline run's file); training's end or the test calls it."""
    wandb = _import_wandb()
    if wandb is not None and wandb.run is not None:
        wandb.finish()
