"""``--keep-best-checkpoints N``: fairseq's ``checkpoint.best_{metric}_{value}.pt`` files, the N best kept.

fairseq names each one ``checkpoint.best_{metric}_{value:.3f}{digit}.pt``, where ``digit`` is a
random draw in [0, N) seeded by (epoch, updates, value) to tell ties apart, and reads the value
back from the name with the digit attached (so 2.345 with digit 1 ranks as 2.3451). A new one is
written when its value is at least as good as the worst one kept (or, with none kept yet, as the
best so far); then all but the N best are removed.
"""

from __future__ import annotations

import os
import re
from typing import List, Optional, Tuple

import numpy as np

from toolkit.config import CheckpointConfig


def _pattern(metric: str, folders: bool) -> re.Pattern[str]:
    return re.compile(r"checkpoint\.best_{}_(\d+\.?\d*){}".format(re.escape(metric), "" if folders else r"\.pt"))


def tie_digit(epoch: int, num_updates: int, value: float, keep: int) -> int:
    """fairseq's ``numpy_seed(epoch, updates, val_loss)`` then ``randint(0, keep)``."""
    return int(np.random.RandomState(int(hash((epoch, num_updates, value)) % 1e6)).randint(0, keep))


def best_name(cfg: CheckpointConfig, epoch: int, num_updates: int, value: float) -> str:
    digit = tie_digit(epoch, num_updates, value, cfg.keep_best_checkpoints)
    return f"checkpoint.best_{cfg.best_checkpoint_metric}_{value:.3f}{digit}.pt"


def kept(cfg: CheckpointConfig, folders: bool = False) -> List[Tuple[float, str]]:
    """(value as fairseq reads it, path) of the kept files, best first."""
    if not os.path.isdir(cfg.save_dir):
        return []
    regex = _pattern(cfg.best_checkpoint_metric, folders)
    found = []
    for name in os.listdir(cfg.save_dir):
        m = regex.fullmatch(name)
        path = os.path.join(cfg.save_dir, name)
        if m and os.path.isdir(path) == folders:
            found.append((float(m.group(1)), path))
    return sorted(found, reverse=cfg.maximize_best_checkpoint_metric)


def should_write(cfg: CheckpointConfig, value: float, best_so_far: Optional[float]) -> bool:
    """At least as good as the worst kept one (none kept: as the best so far, this value included)."""
    files = kept(cfg, folders=cfg.use_sharded_state)
    maximize = cfg.maximize_best_checkpoint_metric
    if files:
        worst: Optional[float] = files[-1][0]
    elif best_so_far is None:
        worst = None
    else:
        worst = max(best_so_far, value) if maximize else min(best_so_far, value)
    return worst is None or (value >= worst if maximize else value <= worst)


def prune_best(cfg: CheckpointConfig, folders: bool = False) -> None:
    import shutil

    if cfg.keep_best_checkpoints <= 0:
        return
    for _, path in kept(cfg, folders)[cfg.keep_best_checkpoints :]:
        if folders:
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
