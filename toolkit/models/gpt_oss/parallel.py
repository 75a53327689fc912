"""The parallelism plan of the gpt-oss family as data: the MoE family's (attention split by heads, the experts in
the plan's expert slot, ``ep_shard``: each stack and its biases cut over the ``ep`` ranks). Tensor parallelism
is refused for the family (``toolkit.config.composition``: the per-head sinks are not split with the heads yet);
FSDP2, expert and context parallelism take the plan as it is.
"""

from __future__ import annotations

import torch.nn as nn

from toolkit.core.protocols import TensorParallelPlan
from toolkit.models.moe.parallel import tensor_parallel_plan as moe_plan


def tensor_parallel_plan(model: nn.Module) -> TensorParallelPlan:
    return moe_plan(model)
