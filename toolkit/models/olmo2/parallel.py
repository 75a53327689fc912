"""The tensor-parallel plan of the OLMo 2 family as data: its norm-after block's modules and their kinds (the split
is ``common/parallel.py``'s); the model's own modules are every rotary family's."""

from __future__ import annotations

import torch.nn as nn

from toolkit.core.protocols import TensorParallelPlan
from toolkit.models.common.parallel import PROJECTIONS, decoder_plan

BLOCK = {**PROJECTIONS, "post_attention_layernorm": "norm", "post_feedforward_layernorm": "norm"}


def tensor_parallel_plan(model: nn.Module) -> TensorParallelPlan:
    """QK-norm over the whole projections (``--qk-norm-over projection``) splits as ``projection_norm``: the weight
    with the heads, the mean of the squares summed over the ranks (``common/parallel.py``)."""
    return decoder_plan(model, BLOCK)
