"""``--format safetensors``: weights without pickle, and what rebuilds the model around them.

The folder holds ``model.safetensors`` (tensors only), ``config.json`` (the checkpoint's plain
options, the model's resolved options, the dictionary's special indices) and the data-bin's
``dict.txt`` plus the BPE model, so ``from_pretrained(folder)`` needs nothing else and never
unpickles. Tensors that share storage (tied weights) are written once; ``config.json`` names
the aliases and loading restores them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Dict, Tuple

import torch

from toolkit.export.common import DTYPES, StepProgress, copy_data_bin_files, require
from toolkit.export.target import export_directory
from toolkit.inference.safetensors_read import CONFIG, FORMAT_NAME, WEIGHTS


def dedupe_shared(state: Dict[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """Drop tensors that are views of an earlier one (same storage, offset and shape).

    safetensors refuses shared storage; the aliases (dropped name -> kept name) let the
    loader put the same tensor under both names again.
    """
    kept: Dict[str, torch.Tensor] = {}
    aliases: Dict[str, str] = {}
    seen: Dict[Tuple, str] = {}
    for name, tensor in state.items():
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        if tensor.numel() > 0 and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        kept[name] = tensor
    return kept, aliases


def export_config(loaded, dtype: str, aliases: Dict[str, str]) -> Dict[str, Any]:
    """Everything ``toolkit.inference`` needs to rebuild the model, in plain JSON."""
    from toolkit.config import plain_values

    cfg = {k: v for k, v in plain_values(vars(loaded.args)).items() if k != "data"}
    d = loaded.dictionary
    return {
        "format": FORMAT_NAME,
        "version": 1,
        "dtype": dtype,
        "cfg": cfg,
        "model": dataclasses.asdict(loaded.model.cfg),
        "dictionary": {"size": len(d), "bos": d.bos(), "pad": d.pad(), "eos": d.eos(), "unk": d.unk()},
        "tied": aliases,
    }


def export_safetensors(loaded, out_dir: str, dtype: str = "fp32") -> str:
    """Write the folder (atomically: it appears complete or not at all); returns its path."""
    save_file = require("safetensors.torch", "safetensors").save_file
    with StepProgress(3, "safetensors") as progress, export_directory(out_dir) as tmp:
        state = {
            k: v.detach().to(DTYPES[dtype]).contiguous() if v.is_floating_point() else v.detach()
            for k, v in loaded.model.state_dict().items()
        }
        tensors, aliases = dedupe_shared(state)
        progress.advance(f"{len(tensors)} tensors in {dtype} ({len(aliases)} tied aliases)")
        save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={"format": FORMAT_NAME})
        with open(os.path.join(tmp, CONFIG), "w", encoding="utf-8") as f:
            json.dump(export_config(loaded, dtype, aliases), f, indent=2, sort_keys=True)
            f.write("\n")
        progress.advance(f"wrote {WEIGHTS} and {CONFIG}")
        copied = copy_data_bin_files(loaded.data_dir, tmp)
        progress.advance(f"copied {', '.join(copied)}")
    return out_dir
