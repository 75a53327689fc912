"""The default checkpoint format: one ``.pt`` file per name, fairseq's names, written atomically.

A checkpoint is a dict of plain values and tensors, so it loads with ``weights_only=True``::

    {"cfg": {option: value}, "model": state dict, "last_optimizer_state": ..., "optimizer_name": ...,
     "extra_state": {key: state of every plain Stateful}}

It is written from the run's Statefuls (:mod:`toolkit.checkpoint.stateful`) without knowing what
each one is: every tensor entry gathered into full (consolidated) form through
``torch.distributed.checkpoint.state_dict``, keyed by parameter name, so it loads into any world
size and any wrapper (FSDP2, DDP, none), and every other entry under its key in ``extra_state``.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from toolkit.checkpoint import stateful
from toolkit.checkpoint.common import TrainingState, prune, saved_data_parallel_size, saved_line, vocabulary_rows
from toolkit.checkpoint import integrity, layer_pruning
from toolkit.checkpoint import write_errors
from toolkit.checkpoint.safe_pickle import load_refusal
from toolkit.checkpoint.stateful import FULL_STATE, ModelState, OptimizerState  # noqa: F401 (FULL_STATE: re-exported)
from toolkit.config import CheckpointConfig
from toolkit.core.errors import UserError
from toolkit.core.fileio import atomic_write
from toolkit.models import saved_options

logger = logging.getLogger(__name__)

FILE_KEYS = {"optim": "last_optimizer_state"}  # fairseq's name for the optimizer state; other entries: their key
ORDER = ("cfg", "model", "extra_state", "last_optimizer_state", "optimizer_name")  # the files' key order; new ones last


def file_key(key: str) -> str:
    return FILE_KEYS.get(key, key)


def model_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    return ModelState(model).state_dict(full=True)


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    return OptimizerState(model, optimizer, name="").state_dict(full=True)


def build_checkpoint(run_cfg: Dict[str, Any], statefuls: stateful.Statefuls) -> Dict[str, Any]:
    """Collective under sharding: every rank must call it; only rank 0 gets the full tensors.

    Tensor entries a save leaves out (``saved`` False: --no-save-optimizer-state) are not in the file.
    """
    checkpoint: Dict[str, Any] = {"cfg": run_cfg}
    for key, entry in stateful.tensor_entries(statefuls).items():
        if entry.saved:
            checkpoint[file_key(key)] = entry.state_dict(full=True)
    checkpoint["extra_state"] = stateful.extra_state(statefuls)
    checkpoint.update(stateful.side_values(statefuls, saved_only=True))
    return {k: checkpoint[k] for k in sorted(checkpoint, key=lambda k: ORDER.index(k) if k in ORDER else len(ORDER))}


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


def save(
    cfg: CheckpointConfig,
    run_cfg: Dict[str, Any],
    statefuls: stateful.Statefuls,
    progress: TrainingState,
    names: List[str],
    is_master: bool,
) -> None:
    """``progress`` only names the save in its log line."""
    checkpoint = build_checkpoint(run_cfg, statefuls)
    if is_master:
        started = time.perf_counter()
        write_checkpoint(checkpoint, cfg.save_dir, names)
        logger.info(saved_line(os.path.join(cfg.save_dir, names[0]), progress, time.perf_counter() - started))
        prune(cfg)


def load_checkpoint_file(
    path: str, pickled_objects: Optional[Callable[[str], Dict[str, Any]]] = None
) -> Dict[str, Any]:
    """Read a ``.pt`` checkpoint with ``weights_only``: a dict, else one line.

    A file that pickles objects besides tensors is refused, unless the caller passes ``pickled_objects``,
    a reader with its own allowlist (fairseq's files, whose options are an ``argparse.Namespace`` or
    omegaconf: ``toolkit.compat.fairseq.checkpoint``), which then reads it.
    """
    if not os.path.isfile(path):
        raise UserError(f"{path}: checkpoint not found")
    integrity.check_file(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if pickled_objects is None:
            raise load_refusal(path, e) from None
        return pickled_objects(path)
    except Exception as e:  # corrupt file: one line naming what was refused
        raise load_refusal(path, e) from None
    if not isinstance(state, dict):  # torch.save(tensor), a list: every reader asks it for keys
        raise UserError(
            f"{path}: not a checkpoint (it holds a {type(state).__name__}, not a dict with 'model' "
            f"and 'cfg'); give a file saved by toolkit-train or fairseq"
        )
    if "cfg" in state:
        state["cfg"] = saved_options.as_family(state["cfg"], path)
    return state


def embed_rows(model_state_dict: Dict[str, Any]) -> Optional[int]:
    """The dictionary size a model state was trained with (adaptive input: the rows of all its bands)."""
    return vocabulary_rows({k: tuple(v.shape) for k, v in model_state_dict.items()})


def tensor_shapes(state: Any) -> stateful.Shapes:
    """The shapes of a state dict's top-level tensors (a model's; an optimizer state has none at the top)."""
    if not isinstance(state, dict):
        return {}
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def load(
    path: str,
    model_cfg: Any,
    statefuls: stateful.Statefuls,
    progress: TrainingState,
    check: stateful.Check,
    checkpoint: Optional[Dict[str, Any]] = None,
) -> Optional[int]:
    """Restore every entry of ``statefuls`` that this run loads (``check`` first: it refuses another model or
    dictionary before anything is loaded).

    Returns the number of data-parallel replicas the saved data position was counted on.
    """
    checkpoint = load_checkpoint_file(path) if checkpoint is None else checkpoint
    checkpoint = layer_pruning.prune_checkpoint(checkpoint, model_cfg)  # --decoder-layers-to-keep added
    tensors = stateful.tensor_entries(statefuls)
    for key, entry in tensors.items():
        if not entry.optional and file_key(key) not in checkpoint:
            raise UserError(f"{path}: no '{file_key(key)}' in this checkpoint; is it a toolkit checkpoint?")
    check(
        path,
        checkpoint.get("cfg", {}),
        checkpoint.get("extra_state"),
        {key: tensor_shapes(checkpoint.get(file_key(key))) for key in tensors},
    )
    loading = [
        key
        for key, entry in tensors.items()
        if file_key(key) in checkpoint and entry.prepare_load(path, checkpoint, None)
    ]
    for key in loading:
        tensors[key].load_state_dict(checkpoint[file_key(key)], full=True)
    stateful.load_extra_state(statefuls, checkpoint["extra_state"])
    logger.info(f"loaded checkpoint {path} ({progress.loaded_summary()})")
    return saved_data_parallel_size(checkpoint.get("cfg", {}))
