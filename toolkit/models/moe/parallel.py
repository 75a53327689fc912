"""The parallelism plan of the MoE family as data: its pre-norm block's attention and norms split as every rotary
family's (``common/parallel.py``), the experts in the plan's expert slot.

Each block's ``mlp`` (router and stacked experts) is named in ``EXPERTS`` with the placement ``ep_shard``
(the experts' leading dimension E cut over the ``ep`` ranks, tokens exchanged with all-to-all), which
``--expert-parallel-size`` applies (``toolkit.distributed.expert_parallel``). Tensor parallelism does not split
it (torchtitan's layout without expert tensor parallelism): every tp rank holds each of its experts whole, and
FSDP2 shards the ``mlp`` on meshes of its own (``shard_moe_replicated_over_tp``). FSDP2 shards each block as a
unit, experts included, as for the dense families.
"""

from __future__ import annotations

import torch.nn as nn

from toolkit.core.protocols import TensorParallelPlan
from toolkit.models.common.options import kv_heads
from toolkit.models.common.parallel import ATTENTION, decoder_plan

BLOCK = {**ATTENTION, "input_layernorm": "norm", "post_attention_layernorm": "norm"}
EXPERTS = {"mlp": "ep_shard"}


def tensor_parallel_plan(model: nn.Module) -> TensorParallelPlan:
    cfg = model.cfg
    divisible = (("--decoder-kv-heads", kv_heads(cfg)), ("--decoder-attention-heads", cfg.decoder_attention_heads))
    return decoder_plan(model, BLOCK, experts=EXPERTS, divisible=divisible)
