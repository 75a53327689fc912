"""The default checkpoint format: one ``.pt`` file per name, fairseq's names, written atomically.

A checkpoint is a dict of plain values and tensors, so it loads with ``weights_only=True``::

    {"cfg": {option: value}, "model": state dict, "last_optimizer_state": ..., "optimizer_name": ...,
     "extra_state": TrainingState.state_dict()}

Model and optimizer states are gathered into full (consolidated) form through
``torch.distributed.checkpoint.state_dict``, keyed by parameter name, so they load into
any world size and any wrapper (FSDP2, DDP, none).
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from toolkit.checkpoint.dcp_state import (  # DCP imported at the first call
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from toolkit.checkpoint.common import (
    saved_line,
    TrainingState,
    check_resumable,
    saved_data_parallel_size,
    vocabulary_rows,
    check_compatible,
    check_optimizer_switch,
    prune,
    switch_optimizer_state,
)
from toolkit.checkpoint import integrity, layer_pruning
from toolkit.checkpoint import write_errors
from toolkit.checkpoint.safe_pickle import load_refusal
from toolkit.config import CheckpointConfig
from toolkit.core.errors import UserError
from toolkit.core.fileio import atomic_write

logger = logging.getLogger(__name__)

FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


def model_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=FULL_STATE)


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    return get_optimizer_state_dict(model, optimizer, options=FULL_STATE)


def build_checkpoint(run_cfg: Dict[str, Any], trainer, state: TrainingState, optimizer_name: Optional[str]
                     ) -> Dict[str, Any]:
    """Collective under sharding: every rank must call it; only rank 0 gets the full tensors.

    ``optimizer_name`` None leaves the optimizer state out (--no-save-optimizer-state).
    """
    checkpoint = {"cfg": run_cfg, "model": model_state(trainer.model), "extra_state": state.state_dict()}
    if optimizer_name is not None:
        checkpoint["last_optimizer_state"] = optimizer_state(trainer.model, trainer.optimizer)
        checkpoint["optimizer_name"] = optimizer_name
    return checkpoint


def write_checkpoint(checkpoint: Dict[str, Any], save_dir: str, names: List[str]) -> None:
    """Write the first name atomically, then copy it to the others (each atomically); the caller logs it."""
    os.makedirs(save_dir, exist_ok=True)
    first = os.path.join(save_dir, names[0])
    with write_errors.reported(first, save_dir), atomic_write(first, "wb") as f:
        torch.save(checkpoint, f)
    for name in names[1:]:  # a failed copy names its own target (disk full at checkpoint_last.pt), not the first
        target = os.path.join(save_dir, name)
        with write_errors.reported(target, save_dir), atomic_write(target, "wb") as dst, open(first, "rb") as src:
            while chunk := src.read(16 << 20):
                dst.write(chunk)


def save(cfg: CheckpointConfig, run_cfg: Dict[str, Any], trainer, state: TrainingState, names: List[str],
         optimizer_name: Optional[str], is_master: bool) -> None:
    checkpoint = build_checkpoint(run_cfg, trainer, state, optimizer_name)
    if is_master:
        started = time.perf_counter()
        write_checkpoint(checkpoint, cfg.save_dir, names)
        logger.info(saved_line(os.path.join(cfg.save_dir, names[0]), state, time.perf_counter() - started))
        prune(cfg)


def load_checkpoint_file(path: str) -> Dict[str, Any]:
    """Read a consolidated checkpoint; refuses anything that needs unpickling arbitrary objects."""
    if not os.path.isfile(path):
        raise UserError(f"{path}: checkpoint not found")
    integrity.check_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt file, or a pickle with arbitrary objects: one line naming what was refused
        raise load_refusal(path, e) from None


def embed_rows(model_state_dict: Dict[str, Any]) -> Optional[int]:
    """The dictionary size a model state was trained with (adaptive input: the rows of all its bands)."""
    return vocabulary_rows({k: tuple(v.shape) for k, v in model_state_dict.items()})


def load(path: str, cfg: CheckpointConfig, model_cfg: Any, optimizer_name: str, trainer,
         state: TrainingState, checkpoint: Optional[Dict[str, Any]] = None
         ) -> Tuple[Optional[Dict[str, Any]], Optional[int]]:
    """Restore model, optimizer (unless --reset-optimizer) and training state.

    Returns the saved data position and the number of data-parallel replicas it was counted on.
    """
    checkpoint = load_checkpoint_file(path) if checkpoint is None else checkpoint
    checkpoint = layer_pruning.prune_checkpoint(checkpoint, model_cfg)  # --decoder-layers-to-keep added
    check_compatible(path, checkpoint.get("cfg", {}), model_cfg, embed_rows(checkpoint["model"]),
                     len(trainer.task.dictionary))
    check_resumable(path, checkpoint.get("cfg", {}), checkpoint.get("extra_state"),
                    {k: tuple(v.shape) for k, v in checkpoint["model"].items()}, model_cfg, trainer)
    set_model_state_dict(trainer.model, checkpoint["model"], options=FULL_STATE)
    if not cfg.reset_optimizer and "last_optimizer_state" in checkpoint:
        saved, saved_name = checkpoint["last_optimizer_state"], checkpoint.get("optimizer_name")
        if check_optimizer_switch(path, saved_name, optimizer_name):
            saved = switch_optimizer_state(path, saved, saved_name, optimizer_name, trainer.optimizer)
        set_optimizer_state_dict(trainer.model, trainer.optimizer, saved, options=FULL_STATE)
    extra = checkpoint["extra_state"]
    position = state.load_state_dict(extra, cfg)
    logger.info(f"loaded checkpoint {path} (epoch {extra['train_iterator'].get('epoch')} "
                f"@ {trainer.num_updates} updates)")
    return position, saved_data_parallel_size(checkpoint.get("cfg", {}))
