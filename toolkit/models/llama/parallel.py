"""The tensor-parallel plan of the Llama family as data: its pre-norm block's modules and their kinds (the split
is ``common/parallel.py``'s, torchtitan's ``apply_tp``); the model's own modules are every rotary family's."""

from __future__ import annotations

import torch.nn as nn

from toolkit.core.protocols import TensorParallelPlan
from toolkit.models.common.parallel import PROJECTIONS, decoder_plan

BLOCK = {**PROJECTIONS, "input_layernorm": "norm", "post_attention_layernorm": "norm"}


def tensor_parallel_plan(model: nn.Module) -> TensorParallelPlan:
    return decoder_plan(model, BLOCK)
