"""The one door from the layers above into fairseq's checkpoint files (and the model outputs its scripts read).

The run's checkpoint manager (``train/checkpoint_manager.py``), model loading (``toolkit.inference``) and
EMA (``train/ema.py``) accept toolkit and fairseq checkpoints alike. Each function here takes any
checkpoint, does the fairseq part where the file is fairseq's and nothing otherwise, so those callers never
ask "is this fairseq?" and the fairseq details (its names, options, optimizer history, ``-shard`` sets)
stay in this package.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import torch

from toolkit.compat.fairseq import checkpoint as fairseq_checkpoint
from toolkit.compat.fairseq import export as fairseq_export
from toolkit.compat.fairseq import model_outputs
from toolkit.compat.fairseq import shards as fairseq_shards
from toolkit.core import registry

logger = logging.getLogger("toolkit.checkpoint.manager")  # the resume's log lines keep the manager's name


def read_checkpoint(path: str) -> Dict[str, Any]:
    """Any ``.pt`` checkpoint, ours or fairseq's, with ``weights_only`` (fairseq's options through an allowlist)."""
    return fairseq_checkpoint.read_checkpoint(path)


def is_fairseq_checkpoint(state: Any) -> bool:
    """Only for fairseq's own Python API (``toolkit.checkpoint_utils``), which hands fairseq's files back in
    fairseq's layout; the library's loaders use the functions below and never ask."""
    return fairseq_checkpoint.is_fairseq_checkpoint(state)


def as_toolkit_state(path: str, state: Dict[str, Any]) -> Dict[str, Any]:
    """``{"cfg", "model", ...}`` under our names: a fairseq file's options and weights imported, ours as is."""
    if not fairseq_checkpoint.is_fairseq_checkpoint(state):
        return state
    registry.import_all_components()
    return fairseq_checkpoint.import_checkpoint(path, state, registry.resolve_arch("transformer_lm").config)


def model_weights(path: str, model: torch.nn.Module, state: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The weights to load into ``model`` from ``as_toolkit_state``'s result: a fairseq file's
    adaptive-softmax aliases folded onto ``model``'s names and checked, ours as they are."""
    if "fairseq_source" not in state:
        return state["model"]
    weights = fairseq_checkpoint.fold_adaptive_aliases(path, model, state["model"])
    fairseq_checkpoint.check_weights(path, model, weights, state["fairseq_source"])
    return weights


def load_weights_into_trainer(path: str, state: Dict[str, Any], trainer) -> bool:
    """A fine-tuning start from ``state``: a fairseq checkpoint's weights loaded into ``trainer`` (True);
    False when ``state`` is ours, which the caller loads itself."""
    if not fairseq_checkpoint.is_fairseq_checkpoint(state):
        return False
    fairseq_checkpoint.load_fairseq_into_trainer(path, trainer, reset_optimizer=True, state=state)
    return True


def resume_trainer(path: str, state: Dict[str, Any], trainer, reset_optimizer: bool) -> Optional[Dict[str, Any]]:
    """A resume from a fairseq checkpoint: its weights, Adam moments (unless ``reset_optimizer``) and update
    count into ``trainer``; returns the data iterator's position, the saved epoch started over (fairseq's
    data position does not map onto ours). None when ``state`` is ours, which the caller loads itself."""
    if not fairseq_checkpoint.is_fairseq_checkpoint(state):
        return None
    info = fairseq_checkpoint.load_fairseq_into_trainer(path, trainer, reset_optimizer, state=state)
    trainer.load_state_dict({"num_updates": info["num_updates"]}, reset_lr_scheduler=True)
    logger.info(f"loaded fairseq checkpoint {path} (epoch {info['epoch']} @ {info['num_updates']} updates)")
    return {"epoch": info["epoch"], "iterations_in_epoch": 0, "shuffle": True}


def average_weights(
    path: str, state: Dict[str, Any], saved: Dict[str, torch.Tensor], model: torch.nn.Module
) -> Dict[str, torch.Tensor]:
    """The moving average ``saved`` in checkpoint ``state`` under our names: fairseq's (its model's
    ``state_dict()``) mapped as its model weights are, ours as is."""
    if not fairseq_checkpoint.is_fairseq_checkpoint(state):
        return saved
    imported = as_toolkit_state(f"--ema-seed-model {path}", dict(state, model=saved))
    return fairseq_checkpoint.fold_adaptive_aliases(path, model, imported["model"])


def shard_files(path: str) -> List[str]:
    """fairseq's ``-shard{N}.pt`` set standing for the missing file ``path`` (empty when there is none)."""
    return fairseq_shards.fairseq_shard_files(path)


def load_shards(shards: List[str], ckpt_cfg, trainer, state) -> Optional[Dict[str, Any]]:
    """Resume from a fairseq ``-shard`` set (see :mod:`toolkit.compat.fairseq.shards`)."""
    return fairseq_shards.load(shards, ckpt_cfg, trainer, state)


def write_fairseq_checkpoint(path: str, output: str) -> Dict[str, int]:
    """A consolidated toolkit checkpoint's model in fairseq's ``transformer_lm`` layout at ``output``
    (``toolkit-consolidate --to-fairseq``); ``{"tensors", "params"}`` written."""
    return fairseq_export.export(path, output)


def with_fairseq_outputs(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` returning fairseq's ``(logits, extra)`` when called (for fairseq's Python API: the hub's
    models, ``load_model_ensemble_and_task``); see :mod:`toolkit.compat.fairseq.model_outputs`."""
    return model_outputs.return_fairseq_outputs(model)
