"""The tensor-parallel plan of the OLMo 2 family as data: its norm-after block's modules and their kinds (the split
is ``common/parallel.py``'s); the model's own modules are every rotary family's."""

from __future__ import annotations

import torch.nn as nn

from toolkit.core.protocols import TensorParallelPlan
from toolkit.models.common.parallel import PROJECTIONS, decoder_plan

BLOCK = {**PROJECTIONS, "post_attention_layernorm": "norm", "post_feedforward_layernorm": "norm"}
ACROSS_HEADS = (
    "--qk-norm-over projection (OLMo 2) normalizes q and k over all heads, which a split by "
    "heads puts on different ranks; train it with FSDP (--model-parallel-size 1)"
)


def tensor_parallel_plan(model: nn.Module) -> TensorParallelPlan:
    cfg = model.cfg
    across_heads = cfg.qk_norm and cfg.qk_norm_over == "projection"
    return decoder_plan(model, BLOCK, unsupported=ACROSS_HEADS if across_heads else None)
