"""The parallelism plan of the Qwen3-Next family as data: the experts in the plan's expert slot (``ep_shard``,
placed by ``--expert-parallel-size``; none in Qwen3.5's dense models), FSDP2 sharding each block as a unit.

Tensor parallelism is refused for the family (``config/composition.py``): its gated DeltaNet layers have no split
by heads here (``in_proj_qkvz`` interleaves each key head's q, k, v and z), so the block names only what every
block has, its two norms, and the plan serves expert parallelism and ``toolkit-plan``'s counts.
"""

from __future__ import annotations

import torch.nn as nn

from toolkit.core.protocols import TensorParallelPlan
from toolkit.models.common.parallel import decoder_plan
from toolkit.models.moe.parallel import EXPERTS

BLOCK = {"input_layernorm": "norm", "post_attention_layernorm": "norm"}


def tensor_parallel_plan(model: nn.Module) -> TensorParallelPlan:
    experts = {} if model.cfg.dense_mlp else EXPERTS
    return decoder_plan(model, BLOCK, experts=experts)
