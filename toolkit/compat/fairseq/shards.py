"""fairseq's sharded checkpoints (``checkpoint_last-shard{N}.pt`` sets) given to ``--restore-file``: read-only.

Loaded when shard 0 holds a full model state under our parameter names (fairseq's
``decoder.`` prefix stripped); refused with a one-line reason otherwise (FSDP flat
parameters, Python objects that would need unpickling, other names or shapes).
"""

from __future__ import annotations

import glob
import logging
import re
from typing import Any, Dict, List, Optional

import torch
from toolkit.checkpoint.dcp_state import StateDictOptions, get_model_state_dict, set_model_state_dict

from toolkit.checkpoint.common import TrainingState, first_line
from toolkit.config import CheckpointConfig
from toolkit.core.errors import UserError
from toolkit.models.init import canonical_name

logger = logging.getLogger("toolkit.checkpoint.fairseq_shards")  # the logger name log lines and filters already use


def fairseq_shard_files(path: str) -> List[str]:
    stem = path[:-3] if path.endswith(".pt") else path
    found = {}
    for f in glob.glob(glob.escape(stem) + "-shard*.pt"):
        m = re.fullmatch(re.escape(stem) + r"-shard(\d+)\.pt", f)
        if m:
            found[int(m.group(1))] = f
    if not found:
        return []
    missing = [i for i in range(max(found) + 1) if i not in found]
    if missing:
        raise UserError(f"{stem}-shard*.pt: shard {missing[0]} of {max(found) + 1} is missing")
    return [found[i] for i in range(len(found))]


def _fairseq_refuse(files: List[str], why: str) -> UserError:
    return UserError(f"{files[0]}: fairseq sharded checkpoint ({len(files)} files) cannot be loaded: {why}")


def _read_shard_zero(files: List[str]) -> Dict[str, Any]:
    try:
        state = torch.load(files[0], map_location="cpu", weights_only=True)
    except Exception as e:
        raise _fairseq_refuse(
            files,
            f"it pickles Python objects that are unsafe to load ({first_line(e)[:120]}); "
            f"consolidate and convert it with fairseq first",
        ) from None
    model_state = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model_state, dict):
        raise _fairseq_refuse(files, "it has no 'model' state")
    if any("flat_param" in k or "_fsdp_wrapped_module" in k for k in model_state) or "shard_metadata" in state:
        raise _fairseq_refuse(
            files,
            "it holds FSDP flat-parameter shards; merge them into one checkpoint with "
            "fairseq's consolidate_fsdp_shards first",
        )
    return state


def _renamed_model_state(
    files: List[str], model_state: Dict[str, torch.Tensor], model: torch.nn.Module
) -> Dict[str, torch.Tensor]:
    ours = {k: tuple(v.shape) for k, v in get_model_state_dict(model).items()}
    renamed = {}
    for k, v in model_state.items():
        name = canonical_name(k[len("decoder.") :] if k.startswith("decoder.") else k)
        if name in ours:
            renamed[name] = v
    missing = [k for k in ours if k not in renamed]
    if missing:
        raise _fairseq_refuse(
            files,
            f"its parameter names do not match this model's (no {missing[0]}; {len(missing)} of {len(ours)} missing)",
        )
    wrong = [k for k, v in renamed.items() if tuple(v.shape) != ours[k]]
    if wrong:
        raise _fairseq_refuse(
            files, f"{wrong[0]} has shape {tuple(renamed[wrong[0]].shape)}, this model has {ours[wrong[0]]}"
        )
    return renamed


def load(files: List[str], cfg: CheckpointConfig, trainer, state: TrainingState) -> Optional[Dict[str, Any]]:
    """A fairseq ``-shard{N}.pt`` set: loaded if shard 0 holds the full model under our names, else refused.

    Returns the saved data position (its optimizer and scheduler state are not used).
    """
    saved = _read_shard_zero(files)
    set_model_state_dict(
        trainer.model,
        _renamed_model_state(files, saved["model"], trainer.model),
        options=StateDictOptions(full_state_dict=True),
    )
    history = saved.get("optimizer_history") or [{}]
    extra = saved.get("extra_state") if isinstance(saved.get("extra_state"), dict) else {}
    num_updates = int((history[-1] if isinstance(history[-1], dict) else {}).get("num_updates", 0))
    trainer.load_state_dict({"num_updates": num_updates}, reset_lr_scheduler=True)
    logger.warning(
        f"loaded the model from fairseq shard set {files[0]} ({len(files)} files) @ {num_updates} "
        f"updates; its optimizer and scheduler state are not loaded"
    )
    best = extra.get("best")
    state.best.best = best if isinstance(best, (int, float)) else None
    return extra.get("train_iterator") if not cfg.reset_dataloader else None
