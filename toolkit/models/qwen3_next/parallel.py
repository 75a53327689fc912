"""The parallelism plan of the Qwen3-Next family as data: the MoE family's (experts placed by
``--expert-parallel-size``; FSDP2 shards each block as a unit). Tensor parallelism is refused for the family
(``config/composition.py``): its gated DeltaNet layers have no split by heads here (their fused ``in_proj_qkvz``
interleaves each key head's q, k, v and z), so the plan names the full-attention layers' projections only for
``toolkit-plan``'s counts."""

from __future__ import annotations

import torch.nn as nn

from toolkit.core.protocols import TensorParallelPlan
from toolkit.models.moe.parallel import tensor_parallel_plan as moe_plan


def tensor_parallel_plan(model: nn.Module) -> TensorParallelPlan:
    return moe_plan(model)
