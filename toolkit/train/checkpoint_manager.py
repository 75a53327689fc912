"""Save and resume: picks the format (consolidated file, DCP folder, fairseq shard set) and the names.

The loop calls :func:`save_checkpoint` and :func:`load_latest`; the formats live in
``toolkit.checkpoint`` (``consolidated``, ``sharded``, what they share in ``common``); fairseq's files
come through :mod:`toolkit.compat.fairseq.adapter`. What a checkpoint holds is the trainer's mapping
of Statefuls (``Trainer.statefuls``), handed to the format as it is; this module adds the checks that
need the run (same model options and dictionary) before anything loads.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, Optional

from toolkit.checkpoint import consolidated, finetune, resume, sharded, stale_files, write_errors
from toolkit.compat.fairseq import adapter as fairseq_adapter
from toolkit.checkpoint.common import (
    TrainingState,
    check_compatible,
    check_resumable,
    checkpoint_names,
    restore_path,
    vocabulary_rows,
)
from toolkit.checkpoint.stateful import ModelState
from toolkit.config import TrainConfig
from toolkit.distributed.utils import DistributedEnv, rescale_iterator_state
from toolkit.models.common.mtp import finetuning_depths
from toolkit.models.lora import finetune_start
from toolkit.train import ema as ema_module
from toolkit.core.errors import UserError

logger = logging.getLogger("toolkit.checkpoint.manager")  # the logger name log lines and filters already use

DEFAULT_RESTORE_FILE = finetune.DEFAULT_RESTORE_FILE


def run_config_dict(cfg: TrainConfig, trainer, env: DistributedEnv) -> Dict[str, Any]:
    """The ``cfg`` a checkpoint stores: every option, with the world size the run really had and its
    number of data-parallel replicas (what the data position is counted in)."""
    return dict(
        cfg.to_dict(), distributed_world_size=env.world_size, data_parallel_size=trainer.strategy.dims.data_world
    )


def save_checkpoint(cfg: TrainConfig, trainer, state: TrainingState, end_of_epoch: bool, env: DistributedEnv) -> None:
    """Every rank calls this (gathering or writing a sharded state is collective)."""
    ckpt_cfg = cfg.checkpoint
    names = checkpoint_names(
        ckpt_cfg, state.epoch_itr.epoch, end_of_epoch, trainer.num_updates, state.val_loss, state.best
    )
    if not names:
        return
    statefuls = state.statefuls()
    saved_best = state.best.best
    if state.val_loss is not None and state.best.is_better(state.val_loss):
        state.best.best = state.val_loss  # the file records the best including this validation
    try:
        if ckpt_cfg.use_sharded_state:
            folder = os.path.join(ckpt_cfg.save_dir, sharded.folder_name(names[0]))
            with write_errors.reported(folder, ckpt_cfg.save_dir, remove=sharded.tmp_path(folder)):
                sharded.save(ckpt_cfg, run_config_dict(cfg, trainer, env), statefuls, state, names, env)
        else:
            with write_errors.reported(os.path.join(ckpt_cfg.save_dir, names[0]), ckpt_cfg.save_dir):
                consolidated.save(ckpt_cfg, run_config_dict(cfg, trainer, env), statefuls, state, names, env.is_master)
    finally:
        state.best.best = saved_best  # the loop updates the tracker itself after saving


def load_latest(cfg: TrainConfig, trainer, state: TrainingState, env: DistributedEnv) -> Optional[Dict[str, Any]]:
    """Resume from --restore-file (default checkpoint_last.pt in --save-dir) when it exists, or start from
    --finetune-from-model's weights (see :mod:`toolkit.checkpoint.finetune`).

    Returns the data iterator's saved position (for this number of data-parallel replicas), or None for a
    fresh start.
    With both ``checkpoint_last.pt`` and ``checkpoint_last/`` present, the newer one is loaded.
    """
    ckpt_cfg = cfg.checkpoint
    last = finetune.restore_path(ckpt_cfg)
    path, finetuning = finetune.choose(ckpt_cfg, os.path.exists(last) or sharded.find_sharded(last) is not None)
    if finetuning:
        _load_finetune_weights(path, fairseq_adapter.read_checkpoint(path), cfg.model, trainer)
        return None
    check = _resume_check(cfg.model, trainer)
    folder = sharded.find_sharded(path)
    if folder is not None and not _file_is_newer(path, folder):
        saved_replicas = sharded.load(folder, state.statefuls(), state, check)
        return rescale_iterator_state(state.saved_position, saved_replicas, trainer.strategy.dims.data_world)
    if os.path.isdir(path):
        raise UserError(
            f"{path}: folder is not a complete sharded checkpoint (no {sharded.DCP_INDEX} and "
            f"{sharded.META_FILE}); it may be from a save that was interrupted"
        )
    if not os.path.exists(path):
        shards = fairseq_adapter.shard_files(path)
        if shards:
            return fairseq_adapter.load_shards(shards, ckpt_cfg, trainer, state)
        finetune.log_fresh_start(ckpt_cfg, path)  # fairseq: a missing --restore-file starts a fresh run
        return None
    checkpoint = fairseq_adapter.read_checkpoint(path)  # weights_only; fairseq's configs through an allowlist
    position = fairseq_adapter.resume_trainer(path, checkpoint, trainer, ckpt_cfg.reset_optimizer)
    if position is not None:  # a file not made of our Statefuls: its EMA is restored here
        _restore_ema(path, checkpoint, trainer, flag="--restore-file")
        return position
    saved_replicas = consolidated.load(path, cfg.model, state.statefuls(), state, check, checkpoint=checkpoint)
    return rescale_iterator_state(state.saved_position, saved_replicas, trainer.strategy.dims.data_world)


def _resume_check(model_cfg: Any, trainer) -> Callable[..., None]:
    """The formats' check before anything loads: this run's model options, parameter names and shapes, and
    dictionary (symbols in order), else one line naming what differs."""

    def check(
        path: str, saved_cfg: Dict[str, Any], extra_state: Optional[Dict[str, Any]], shapes: Dict[str, Dict[str, Any]]
    ) -> None:
        model_shapes = shapes["model"]
        check_compatible(path, saved_cfg, model_cfg, vocabulary_rows(model_shapes), len(trainer.task.dictionary))
        check_resumable(path, saved_cfg, extra_state, model_shapes, model_cfg, trainer.model, trainer.task)

    return check


def _load_finetune_weights(path: str, checkpoint: dict, model_cfg: Any, trainer) -> None:
    """A fine-tuning start: only the model weights of a toolkit or fairseq checkpoint."""
    if not fairseq_adapter.load_weights_into_trainer(path, checkpoint, trainer):
        if "model" not in checkpoint:
            raise UserError(f"--finetune-from-model {path}: no model weights in this file; is it a checkpoint?")
        check_compatible(
            path,
            checkpoint.get("cfg", {}),
            model_cfg,
            consolidated.embed_rows(checkpoint["model"]),
            len(trainer.task.dictionary),
        )
        weights, adapters = finetune_start(trainer.model, checkpoint["model"], checkpoint.get("cfg", {}), path)
        weights, depths = finetuning_depths(trainer.model, weights)
        for line in (adapters, depths):
            if line:
                logger.info(f"--finetune-from-model {path}: {line}")
        ModelState(trainer.model).load_state_dict(weights, full=True)
    _restore_ema(path, checkpoint, trainer, flag="--finetune-from-model")
    logger.info(f"loaded weights of {path} for fine-tuning (0 updates; fresh optimizer and LR schedule)")


def _restore_ema(path: str, checkpoint: dict, trainer, flag: str) -> None:
    """--store-ema: the checkpoint's saved average where it has one, else the loaded weights (fairseq's
    Trainer.load_checkpoint does the same on every load, fine-tuning included)."""
    ema = getattr(trainer, "ema", None)
    if ema is None:
        return
    if not ema_module.has_saved_average(checkpoint):
        logger.warning("EMA not found in checkpoint. But store_ema is True. EMA is re-initialized from checkpoint.")
        ema.reset_from(trainer.model)
        return
    ema.load_state_dict(
        ema_module.saved_average(path, checkpoint, trainer.model, ema.shadow, flag=f"{flag} {path}"), trainer.model
    )
    logger.info("Loading EMA from checkpoint")


def prepare_save_dir(cfg: TrainConfig, env: DistributedEnv) -> None:
    """Remove our own temporary files that crashed saves left in --save-dir (one INFO line)."""
    if env.is_master and os.path.isdir(cfg.checkpoint.save_dir):
        stale_files.remove_stale_temp_files(cfg.checkpoint.save_dir)


def finished_reason(cfg: TrainConfig, trainer, epoch_itr) -> Optional[str]:
    """``| done: ...`` when the loaded checkpoint already meets a stop criterion: restarts are idempotent."""
    name = os.path.basename(restore_path(cfg.checkpoint))
    return resume.finished_reason(
        name,
        resume.StopCriteria.from_config(cfg.optimization),
        trainer.num_updates,
        epoch_itr.next_epoch_idx,
        trainer.get_lr(),
    )


def _file_is_newer(path: str, folder: str) -> bool:
    newer = os.path.isfile(path) and os.path.getmtime(path) > os.path.getmtime(os.path.join(folder, sharded.META_FILE))
    if newer:
        logger.info(f"{path} is newer than {folder}; loading it")
    return newer
