"""fairseq's ``checkpoint_utils`` loading functions, with fairseq's signatures and return shapes.

Why: scripts written for fairseq (scoring, feature extraction, few-shot evaluation) start with
``models, cfg, task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides)``;
with these functions they port by renaming the import (``toolkit.checkpoint_utils`` re-exports them). Loading is
the toolkit's (:func:`toolkit.inference.load_model`: toolkit and fairseq checkpoints, ``weights_only``), reached by
name (``core.registry.load_model_for_eval``): the inference layer reads fairseq's files through this package.

fairseq's ``cfg`` is grouped (``cfg.task.tokens_per_sample``, ``cfg.model._name``); the returned
``cfg`` is a :class:`toolkit.compat.fairseq.hub.GroupedConfig`, which answers both that and the flat names.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from toolkit.core import registry
from toolkit.compat.fairseq.adapter import is_fairseq_checkpoint, read_checkpoint, with_fairseq_outputs
from toolkit.compat.fairseq.hub import GroupedConfig


def load_checkpoint_to_cpu(
    path: str, arg_overrides: Optional[Dict[str, Any]] = None, load_on_all_ranks: bool = False
) -> Dict[str, Any]:
    """The checkpoint's dict on the CPU (``model``, ``cfg``, ``extra_state``, ...); ``arg_overrides``
    replace saved options of a toolkit checkpoint's flat ``cfg`` (fairseq's keep their own layout)."""
    state = read_checkpoint(path)
    if arg_overrides and not is_fairseq_checkpoint(state) and isinstance(state.get("cfg"), dict):
        state["cfg"] = {**state["cfg"], **arg_overrides}
    return state


def _paths(filenames: Union[str, Sequence[str]], suffix: str) -> List[str]:
    names = [filenames] if isinstance(filenames, str) else list(filenames)
    out = []
    for name in names:
        path = name.replace(".pt", suffix + ".pt") if suffix else name
        if not os.path.exists(path):
            raise OSError(f"Model file not found: {path}")
        out.append(path)
    return out


def load_model_ensemble_and_task(
    filenames: Union[str, Sequence[str]],
    arg_overrides: Optional[Dict[str, Any]] = None,
    task=None,
    strict: bool = True,
    suffix: str = "",
    num_shards: int = 1,
    state: Optional[Dict[str, Any]] = None,
) -> Tuple[List[torch.nn.Module], Any, Any]:
    """(models in eval mode on the CPU, cfg, task), as fairseq's; ``model(src_tokens)`` returns fairseq's
    ``(logits, extra)``.

    ``arg_overrides`` replace saved options (``{"data": "data-bin/x"}`` points at another
    data-bin). A ``task`` given is returned as is (its dictionary must be the checkpoint's).
    """
    if num_shards != 1:
        raise ValueError(f"num_shards={num_shards}: load the consolidated checkpoint (toolkit-consolidate) instead")
    if state is not None:
        raise ValueError("state=: pass the checkpoint path; the toolkit reads and checks the file itself")
    overrides = dict(arg_overrides or {})
    data = overrides.pop("data", None)
    models, loaded_task, args = [], None, None
    for path in _paths(filenames, suffix):
        model, path_task, path_args = registry.load_model_for_eval(path, data, torch.device("cpu"), overrides)
        if loaded_task is not None and path_task.dictionary != loaded_task.dictionary:
            raise ValueError(f"{path}: ensemble members must share one dictionary")
        models.append(with_fairseq_outputs(model))  # model(src) gives fairseq's (logits, extra)
        loaded_task, args = loaded_task or path_task, args or path_args
    if task is not None and task.dictionary != loaded_task.dictionary:
        raise ValueError("task=: its dictionary differs from the checkpoint's")
    return models, GroupedConfig(**vars(args)), task or loaded_task


def load_model_ensemble(
    filenames: Union[str, Sequence[str]],
    arg_overrides: Optional[Dict[str, Any]] = None,
    task=None,
    strict: bool = True,
    suffix: str = "",
    num_shards: int = 1,
    state: Optional[Dict[str, Any]] = None,
) -> Tuple[List[torch.nn.Module], Any]:
    """(models, cfg): :func:`load_model_ensemble_and_task` without the task."""
    models, cfg, _ = load_model_ensemble_and_task(filenames, arg_overrides, task, strict, suffix, num_shards, state)
    return models, cfg
