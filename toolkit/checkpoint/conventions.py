"""A model's own conventions as ``toolkit-train``'s defaults when it starts from the model's checkpoint.

Why: a model imported with ``toolkit-export --from hf`` was pretrained on its tokenizer's layout (Llama reads
BOS first, Qwen does not) and at its own context; fine-tuned without them it silently learns another task.
The import records them in its checkpoint (``cfg["model_conventions"]``, JSON of ``add_bos_token``,
``tokens_per_sample``, ``max_target_positions``: ``toolkit.models.hf_checkpoint.model_conventions``), every
checkpoint of a run that started from it records them again (``CheckpointConfig.model_conventions``), and
here they become the defaults of the options the user did not give, each applied one INFO line; an option the
user gave that differs from the model's own is kept, with one WARNING line. eval-lm, the hub and generation
read a checkpoint's ``cfg`` itself, which holds the same values.

The checkpoint read is the one the run loads: ``--save-dir``'s ``checkpoint_last`` (or ``--restore-file``)
when it exists, else ``--finetune-from-model``; only its ``cfg`` is read (memory-mapped, no tensor loaded).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from toolkit.checkpoint import finetune, sharded
from toolkit.config import CheckpointConfig

#: (section of TrainConfig, option) of each convention
WHERE = {"add_bos_token": "task", "tokens_per_sample": "task", "max_target_positions": "model"}
#: why a flag that differs from the model's own convention is worth a line (only these are warned about)
CONFLICTS = {
    "add_bos_token": "its tokenizer {reads} BOS first, as the model was pretrained",
    "max_target_positions": "its context is {value} positions",
}
#: flags that extend a rotary model's context on purpose (docs/long_context.md): another
#: --max-target-positions with one of them is the extension, said in an INFO line, not warned about
CONTEXT_EXTENSION = ("rope_scaling", "rope_scaling_factor", "rope_theta")


def source_checkpoint(cfg: CheckpointConfig) -> Optional[str]:
    """The checkpoint this run will load: its own last one (or ``--restore-file``) if present, else
    ``--finetune-from-model``."""
    last = finetune.restore_path(cfg)
    if os.path.isfile(last) or sharded.find_sharded(last) is not None:
        return last
    return cfg.finetune_from_model


def read_conventions(path: Optional[str]) -> Optional[Dict[str, Any]]:
    """The conventions ``path`` records, or None (no such file, no record, not a toolkit checkpoint: the load
    itself reports what is wrong with the file)."""
    if not path:
        return None
    try:
        folder = path if os.path.isdir(path) else sharded.find_sharded(path)
        if folder is not None:
            saved = sharded.read_meta(folder).get("cfg", {})
        elif os.path.isfile(path):
            saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("cfg", {})
        else:
            return None
        record = saved.get("model_conventions") if isinstance(saved, dict) else None
        values = json.loads(record) if isinstance(record, str) else None
    except Exception:  # a fairseq or damaged file: loading it later names the problem
        return None
    return {k: v for k, v in values.items() if k in WHERE} if isinstance(values, dict) else None


def apply_conventions(cfg, explicit: Set[str]) -> Tuple[Any, List[Tuple[str, str]]]:
    """``cfg`` (a TrainConfig) with the loaded checkpoint's conventions as defaults; the lines to log as
    ``(level, message)``."""
    path = source_checkpoint(cfg.checkpoint)
    conventions = read_conventions(path)
    if not conventions:
        return cfg, []
    lines: List[Tuple[str, str]] = []
    sections: Dict[str, Dict[str, Any]] = {"task": {}, "model": {}}
    for key, value in sorted(conventions.items()):
        section = getattr(cfg, WHERE[key])
        if section is None or not hasattr(section, key):
            continue
        flag = "--" + key.replace("_", "-")
        current = getattr(section, key)
        if key not in explicit:
            if current != value:
                sections[WHERE[key]][key] = value
                shown = flag if value is True else f"--no-{flag[2:]}" if value is False else f"{flag} {value}"
                lines.append(("info", f"{shown}: the model's own convention, from {path}"))
        elif current != value and key in CONFLICTS:
            why = CONFLICTS[key].format(reads="reads" if value else "puts no", value=value)
            given = flag if current is True else f"--no-{flag[2:]}" if current is False else f"{flag} {current}"
            extends = key == "max_target_positions" and explicit.intersection(CONTEXT_EXTENSION)
            level, verdict = ("info", "extended by the RoPE flags given") if extends else ("warning", "kept")
            lines.append((level, f"{given}: differs from the model's own convention ({path}: {why}); {verdict}"))
    for name, changes in sections.items():
        if changes:
            cfg = dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **changes)})
    recorded = json.dumps(conventions, sort_keys=True)
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, model_conventions=recorded))
    return cfg, lines
