"""The parallelism plan of the GLM-4.5 family: its block is the MoE family's (grouped-query attention split by
heads, QK-norm per head, the experts in the plan's expert slot, ``ep_shard``; the shared experts whole on every
tensor-parallel rank), and the dense first layers' MLP is split as the dense families' MLP (as in the DeepSeek-V3
family: left whole, its input gradient would be counted once per rank)."""

from __future__ import annotations

import torch.nn as nn

from toolkit.core.protocols import TensorParallelPlan
from toolkit.models.common.options import kv_heads
from toolkit.models.common.parallel import decoder_plan
from toolkit.models.deepseek_v3.parallel import DENSE_MLP, with_prediction_depths
from toolkit.models.moe.parallel import BLOCK, EXPERTS


def tensor_parallel_plan(model: nn.Module) -> TensorParallelPlan:
    cfg = model.cfg
    block = dict(BLOCK)
    divisible = (("--decoder-kv-heads", kv_heads(cfg)), ("--decoder-attention-heads", cfg.decoder_attention_heads))
    if cfg.first_k_dense_replace:  # a MoE block has no mlp.gate_proj: skipped there
        block.update(DENSE_MLP)
        divisible += (("--decoder-ffn-embed-dim", cfg.decoder_ffn_embed_dim),)
    return with_prediction_depths(model, decoder_plan(model, block, experts=EXPERTS, divisible=divisible))
