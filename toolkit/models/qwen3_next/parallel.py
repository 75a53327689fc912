"""The parallelism plan of the Qwen3-Next family as data: the experts in the plan's expert slot (``ep_shard``,
placed by ``--expert-parallel-size``; none in Qwen3.5's dense models), FSDP2 sharding each block as a unit, and the
tensor-parallel split of both kinds of token mixer under the one block plan (a path a block lacks is skipped):

- gated full attention as every rotary family's (``q_proj`` with each head's gate beside its query, column-parallel
  by heads; QK-norm per head; ``o_proj`` row-parallel);
- gated DeltaNet by key heads: ``in_proj_qkvz`` and ``in_proj_ba`` column-parallel, Shard(0) giving each rank whole
  key-head groups (Hugging Face's layout holds each key head's q, k and the v, z, b, a of its value heads
  contiguously), ``A_log`` and ``dt_bias`` split with the value heads and the convolution read on the rank's
  channels (``linear_attention_heads``), the gated norm per head on the rank's heads, ``out_proj`` row-parallel.

The MoE layers stay whole on every tp rank, as the MoE family's (``toolkit.models.moe.parallel``). Qwen3.5's split
projections (``in_proj_qkv`` holds all of q, then k, then v) have no split by heads here: refused under tensor
parallelism by ``toolkit/config/composition.py``.
"""

from __future__ import annotations

import torch.nn as nn

from toolkit.core.protocols import TensorParallelPlan
from toolkit.models.common.options import kv_heads
from toolkit.models.common.parallel import ATTENTION, decoder_plan
from toolkit.models.deepseek_v3.parallel import with_prediction_depths
from toolkit.models.moe.parallel import EXPERTS

GATED_ATTENTION = {**ATTENTION, "self_attn.q_norm": "head_norm", "self_attn.k_norm": "head_norm"}
GATED_DELTANET = {
    "self_attn": "linear_attention_heads",
    "self_attn.in_proj_qkvz": "column",
    "self_attn.in_proj_ba": "column",
    "self_attn.norm": "replicated_partial",
    "self_attn.out_proj": "row",
}
DENSE_MLP = {"mlp.gate_proj": "column", "mlp.up_proj": "column", "mlp.down_proj": "row"}
BLOCK = {**GATED_ATTENTION, **GATED_DELTANET, "input_layernorm": "norm", "post_attention_layernorm": "norm"}


def tensor_parallel_plan(model: nn.Module) -> TensorParallelPlan:
    cfg = model.cfg
    divisible = (
        ("--linear-num-key-heads", cfg.linear_num_key_heads),
        ("--decoder-kv-heads", kv_heads(cfg)),
        ("--decoder-attention-heads", cfg.decoder_attention_heads),
    )
    if cfg.dense_mlp:
        divisible += (("--decoder-ffn-embed-dim", cfg.decoder_ffn_embed_dim),)
    block, experts = ({**BLOCK, **DENSE_MLP}, {}) if cfg.dense_mlp else (BLOCK, EXPERTS)
    built = {name for layer in model.layers for name, _ in layer.named_modules()}
    block = {path: kind for path, kind in block.items() if path in built}  # the layer kinds this model has
    return with_prediction_depths(model, decoder_plan(model, block, experts=experts, divisible=divisible))
