"""Reading a ``toolkit-export --format safetensors`` folder back as a checkpoint-shaped dict.

The writer is :mod:`toolkit.export.safetensors_format`; the reader lives here, in the inference layer,
because loading a model (``toolkit.inference.load_model``, the hub) accepts such a folder and the
inference layer sits below export.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict

from toolkit.core.errors import UserError, import_optional
from toolkit.models import saved_options

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
FORMAT_NAME = "toolkit-safetensors"


def is_exported_folder(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, WEIGHTS)) and os.path.isfile(os.path.join(folder, CONFIG))


def read_exported(path: str) -> Dict[str, Any]:
    """A checkpoint-shaped dict ``{"cfg", "model"}`` from ``model.safetensors`` and its ``config.json``.

    Values are fp32 whatever the stored dtype, as a training checkpoint's are.
    """
    load_file = import_optional(
        "safetensors.torch", "safetensors is not installed; pip install toolkit[export] (or: pip install safetensors)"
    ).load_file
    config_path = os.path.join(os.path.dirname(os.path.abspath(path)), CONFIG)
    if not os.path.isfile(path) or not os.path.isfile(config_path):
        raise UserError(
            f"{path}: needs {CONFIG} beside it; give a folder written by toolkit-export --format safetensors"
        )
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("format") != FORMAT_NAME:
        raise UserError(
            f"{config_path}: not written by toolkit-export --format safetensors (format {config.get('format')!r})"
        )
    tensors = load_file(path)
    for alias, name in config.get("tied", {}).items():
        tensors[alias] = tensors[name]
    state = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
    cfg = dict(config["cfg"])
    cfg.update(config.get("model", {}))
    cfg.setdefault("data", os.path.dirname(os.path.abspath(path)))
    return {"cfg": saved_options.as_family(cfg, config_path), "model": state}
