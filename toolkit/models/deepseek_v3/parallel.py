"""The parallelism plan of the DeepSeek-V3 family as data: its pre-norm block's latent attention split by heads
(the query and key/value up-projections column-parallel, the output row-parallel), the compressions and their
norms whole on every rank, the experts in the plan's expert slot as the MoE family's (``ep_shard``; a dense
first layer's MLP is no ``GroupedExperts`` and stays as it is).
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from toolkit.core.protocols import TensorParallelPlan
from toolkit.models.common.parallel import decoder_plan

LATENT_ATTENTION = {
    "self_attn.kv_a_proj_with_mqa": "replicated",
    "self_attn.kv_a_layernorm": "replicated",
    "self_attn.kv_b_proj": "column",
    "self_attn.o_proj": "row",
}
QUERY_LOW_RANK = {
    "self_attn.q_a_proj": "replicated",
    "self_attn.q_a_layernorm": "replicated",
    "self_attn.q_b_proj": "column",
}
QUERY = {"self_attn.q_proj": "column"}
NORMS = {"input_layernorm": "norm", "post_attention_layernorm": "norm"}
EXPERTS = {"mlp": "ep_shard"}


def tensor_parallel_plan(model: nn.Module) -> TensorParallelPlan:
    cfg = model.cfg
    queries = QUERY if cfg.q_lora_rank is None else QUERY_LOW_RANK
    block = {**queries, **LATENT_ATTENTION, **NORMS}
    plan = decoder_plan(
        model, block, experts=EXPERTS, divisible=(("--decoder-attention-heads", cfg.decoder_attention_heads),)
    )
    # the multi-token prediction depths are FSDP2 units as the blocks are (their experts placed the same way)
    return dataclasses.replace(plan, fsdp_units=("layers", "mtp")) if len(model.mtp) else plan
