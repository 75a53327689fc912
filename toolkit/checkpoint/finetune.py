"""``--finetune-from-model`` and which file ``--restore-file`` names, with fairseq's rules
(``fairseq.checkpoint_utils.load_checkpoint``).

* ``--restore-file`` at its default (``checkpoint_last.pt``) is read in ``--save-dir``; any other
  path is read as given, relative to the working directory.
* ``--finetune-from-model PATH`` applies only when ``--save-dir`` has no ``checkpoint_last.pt``
  (a restarted fine-tuning run resumes from its own last checkpoint): the weights of PATH (a
  toolkit or fairseq checkpoint) with a fresh optimizer, LR schedule, meters and data position.
  It cannot be combined with another ``--restore-file`` or with the ``--reset-*`` flags
  (fairseq refuses both).
"""

from __future__ import annotations

import logging
import os
from typing import Tuple

from toolkit.config import CheckpointConfig
from toolkit.core.errors import UserError

logger = logging.getLogger(__name__)

DEFAULT_RESTORE_FILE = "checkpoint_last.pt"
RESET_FLAGS = ("reset_optimizer", "reset_lr_scheduler", "reset_meters", "reset_dataloader")


def check_flags(cfg: CheckpointConfig) -> None:
    if cfg.finetune_from_model is None:
        return
    if cfg.restore_file != DEFAULT_RESTORE_FILE:
        raise UserError(
            f"--finetune-from-model and --restore-file {cfg.restore_file} cannot be given together; keep one"
        )
    given = [f"--{f.replace('_', '-')}" for f in RESET_FLAGS if getattr(cfg, f)]
    if given:
        raise UserError(
            f"--finetune-from-model cannot be given with {', '.join(given)} (it resets the optimizer, "
            f"LR scheduler, meters and data position itself); drop {given[0]}"
        )


def restore_path(cfg: CheckpointConfig) -> str:
    """fairseq's: the default name in --save-dir, any other path relative to the working directory."""
    if cfg.restore_file == DEFAULT_RESTORE_FILE:
        return os.path.join(cfg.save_dir, DEFAULT_RESTORE_FILE)
    return cfg.restore_file


def choose(cfg: CheckpointConfig, last_exists: bool) -> Tuple[str, bool]:
    """(path to load, whether it is a fine-tuning start: weights only)."""
    check_flags(cfg)
    path = restore_path(cfg)
    if cfg.finetune_from_model is None or last_exists:
        return path, False
    if not os.path.isfile(cfg.finetune_from_model):
        raise UserError(f"--finetune-from-model {cfg.finetune_from_model}: file not found")
    logger.info(
        f"loading pretrained model from {cfg.finetune_from_model}: optimizer, lr scheduler, meters, "
        f"dataloader will be reset"
    )
    return cfg.finetune_from_model, True


def log_fresh_start(cfg: CheckpointConfig, path: str) -> None:
    logger.info(f"No existing checkpoint found {path}")
    beside = os.path.join(cfg.save_dir, cfg.restore_file)
    if cfg.restore_file != DEFAULT_RESTORE_FILE and not os.path.isabs(cfg.restore_file) and os.path.exists(beside):
        logger.warning(
            f"--restore-file {cfg.restore_file} is read relative to the working directory (as in "
            f"fairseq), not --save-dir; did you mean --restore-file {beside}?"
        )
