"""LayerDrop (Fan et al., 2019: https://arxiv.org/abs/1909.11556), fairseq's ``--decoder-layerdrop`` and
``--decoder-layers-to-keep``.

Training skips each layer with probability ``p`` (fairseq's ``LayerDropModuleList``: a layer runs
when its uniform draw is above ``p``; evaluation runs every layer). A model trained so can be pruned:
``--decoder-layers-to-keep 0,2,4`` builds 3 layers and loads layers 0, 2 and 4 of a full checkpoint
as layers 0, 1 and 2 (fairseq's ``prune_state_dict``).

Every data-parallel rank must skip the same layers: FSDP2 gathers a block's parameters with a
collective, and DDP reduces the same parameters everywhere. So the draws do not come from the
global generator (whose state differs between ranks once dropout has consumed batches of
different sizes) but from a generator seeded by ``torch.initial_seed()``, which the trainer
sets to ``seed + num_updates`` on every rank before each update, and the number of draws since.
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from toolkit.core.errors import UserError

logger = logging.getLogger(__name__)


class LayerDrop(nn.Module):
    """Which layers run in this forward pass; holds no parameters."""

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise UserError(f"--decoder-layerdrop: a probability in [0, 1) is needed, got {p}")
        self.p = p
        self._seed: Optional[int] = None
        self._draws = 0

    def keep(self, num_layers: int) -> List[bool]:
        if not self.training or self.p == 0.0:
            return [True] * num_layers
        seed = torch.initial_seed()
        if seed != self._seed:
            self._seed, self._draws = seed, 0
        digest = hashlib.sha256(f"layerdrop/{seed}/{self._draws}".encode()).digest()
        self._draws += 1
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        draws = torch.empty(num_layers).uniform_(generator=generator)
        return [bool(d > self.p) for d in draws]

    def extra_repr(self) -> str:
        return f"p={self.p}"


def parse_layers_to_keep(text: Optional[str]) -> Optional[List[int]]:
    """The sorted layer indices of ``--decoder-layers-to-keep`` (None when not given)."""
    if text is None or str(text).strip() == "":
        return None
    try:
        keep = [int(v) for v in str(text).split(",")]
    except ValueError:
        raise UserError(
            f"--decoder-layers-to-keep: expected comma-separated layer indices such as '0,2,4', got {text!r}"
        ) from None
    if len(set(keep)) != len(keep) or min(keep) < 0:
        raise UserError(f"--decoder-layers-to-keep: indices must be distinct and >= 0, got {text!r}")
    return sorted(keep)


_LAYER = re.compile(r"^((?:.*\.)?layers\.)(\d+)(\..*)$")


def prune_state_dict(state: Dict[str, Any], keep: List[int], num_layers: int, log: bool = True) -> Dict[str, Any]:
    """Layers ``keep`` of a full state dict, renumbered 0, 1, ...; a state dict that already has
    ``num_layers`` (the pruned model's) layers is returned as it is (a pruned run's own checkpoint).
    Pruning logs fairseq's line (checkpoint_utils.prune_state_dict)."""
    saved = {int(m.group(2)) for m in map(_LAYER.match, state) if m}
    if len(saved) <= num_layers:
        return state
    if log:
        logger.info(
            "Pruning model to specified layer configuration - this works best if the model was trained with LayerDrop"
        )
    missing = [i for i in keep if i not in saved]
    if missing:
        raise UserError(
            f"--decoder-layers-to-keep: layers {missing} are not in the checkpoint (it has layers 0..{max(saved)})"
        )
    new_index = {old: new for new, old in enumerate(keep)}
    out = {}
    for key, value in state.items():
        m = _LAYER.match(key)
        if m is None:
            out[key] = value
        elif int(m.group(2)) in new_index:
            out[f"{m.group(1)}{new_index[int(m.group(2))]}{m.group(3)}"] = value
    return out
