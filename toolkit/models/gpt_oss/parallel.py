"""The parallelism plan of the gpt-oss family as data: the MoE family's (attention split by heads, the experts in
the plan's expert slot, ``ep_shard``: each stack and its biases cut over the ``ep`` ranks). Under tensor
parallelism the q/k/v biases split with their heads, ``o_proj``'s bias stays whole (added once, after the
row-parallel reduce) and the per-head sinks are Shard(0) as the query heads (the ``attention_sinks`` kind the
shared decoder plan gives an attention with sinks, ``common/parallel.py``); FSDP2, expert and context parallelism
take the plan as it is.
"""

from __future__ import annotations

import torch.nn as nn

from toolkit.core.protocols import TensorParallelPlan
from toolkit.models.moe.parallel import tensor_parallel_plan as moe_plan


def tensor_parallel_plan(model: nn.Module) -> TensorParallelPlan:
    return moe_plan(model)
