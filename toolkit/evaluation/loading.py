"""One loader for every checkpoint evaluation accepts.

``inference.load_model`` reads toolkit checkpoints (both model families), fairseq's
``transformer_lm`` checkpoints, ``toolkit-export --format safetensors`` folders and the
``model.pt`` of ``toolkit-export --from hf``. A sharded checkpoint (``--use-sharded-state``:
a DCP folder, or its ``.pt`` name) is consolidated into a temporary file first and loaded
from there, so evaluation never needs ``toolkit-consolidate`` or a process group.
"""

from __future__ import annotations

import os
import tempfile
from typing import Dict, Optional, Tuple

import torch

from toolkit import inference
from toolkit.core.errors import UserError


def load_for_eval(
    path: str,
    data_dir: Optional[str] = None,
    device: torch.device = torch.device("cpu"),
    overrides: Optional[Dict] = None,
) -> Tuple[torch.nn.Module, object, object]:
    """(model in eval mode, task, the checkpoint's options) for ``path``, whatever its format."""
    if os.path.isfile(path):
        return inference.load_model(path, data_dir, device, overrides)
    from toolkit.checkpoint import sharded

    folder = sharded.find_sharded(path)
    if folder is None:
        raise UserError(
            f"--path {path}: no such checkpoint file and no complete sharded checkpoint folder; "
            f"give a .pt file, a sharded folder (toolkit-train --use-sharded-state) or a "
            f"model.safetensors"
        )
    with tempfile.TemporaryDirectory(prefix="toolkit-eval-") as tmp:
        consolidated = os.path.join(tmp, "consolidated.pt")
        sharded.consolidate(folder, consolidated, include_optimizer=False)
        return inference.load_model(consolidated, data_dir, device, overrides)
