"""The parallelism plan of the DeepSeek-V3 family as data: its pre-norm block's latent attention split by heads
(the query and key/value up-projections column-parallel, the output row-parallel), the compressions and their
norms whole on every rank, the experts in the plan's expert slot as the MoE family's (``ep_shard``; a dense
first layer's MLP is no ``GroupedExperts``: expert parallelism leaves it as it is, tensor parallelism splits it as
the dense families' MLP).

Under sequence parallelism a rank holds T/M positions of the stream. The query compression works per position
(``positionwise``: on those T/M, ``q_b_proj`` gathers the sequence as any column-parallel layer does); the
key/value compression gathers the sequence first (``gathered_replicated``): its rotary key part reaches the
attention of every head directly, through no column-parallel layer. Its output feeds this rank's heads, so its
weights' and its norm's gradients are partial sums over the ranks (reduced as the sequence-parallel norms' are).
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from toolkit.core.protocols import TensorParallelPlan
from toolkit.models.common.parallel import decoder_plan

LATENT_ATTENTION = {
    "self_attn.kv_a_proj_with_mqa": "gathered_replicated",  # its rotary key part is every head's: all positions
    "self_attn.kv_a_layernorm": "replicated_partial",
    "self_attn.kv_b_proj": "column_on_gathered",
    "self_attn.o_proj": "row",
}
QUERY_LOW_RANK = {  # per position: on this rank's positions under sequence parallelism, q_b_proj gathers them
    "self_attn.q_a_proj": "positionwise",
    "self_attn.q_a_layernorm": "positionwise",
    "self_attn.q_b_proj": "column",
}
QUERY = {"self_attn.q_proj": "column"}
NORMS = {"input_layernorm": "norm", "post_attention_layernorm": "norm"}
DENSE_MLP = {"mlp.gate_proj": "column", "mlp.up_proj": "column", "mlp.down_proj": "row"}  # the first layers'

EXPERTS = {"mlp": "ep_shard"}


def tensor_parallel_plan(model: nn.Module) -> TensorParallelPlan:
    cfg = model.cfg
    queries = QUERY if cfg.q_lora_rank is None else QUERY_LOW_RANK
    block = {**queries, **LATENT_ATTENTION, **NORMS}
    divisible = (("--decoder-attention-heads", cfg.decoder_attention_heads),)
    if cfg.first_k_dense_replace:  # the dense layers' MLP (a MoE block has no mlp.gate_proj: skipped there)
        block.update(DENSE_MLP)
        divisible += (("--decoder-ffn-embed-dim", cfg.decoder_ffn_embed_dim),)
    return with_prediction_depths(model, decoder_plan(model, block, experts=EXPERTS, divisible=divisible))


def with_prediction_depths(model: nn.Module, plan: TensorParallelPlan) -> TensorParallelPlan:
    """``plan`` of a family with multi-token prediction depths (``common/mtp.py``): the depths are FSDP2 units as
    the blocks are (their experts placed the same way). Under tensor parallelism a depth reads whole sequences on
    every rank (the final norm's replicated output, the whole embedding): its two norms and its joining projection
    are replicated and compute on them; its block is split as the decoder's blocks are (its input cut into this
    rank's positions as the first block's under sequence parallelism), and its norm's output is replicated again
    for the shared head and the next depth (``gathered_norm``)."""
    if not len(model.mtp):
        return plan
    top = dict(plan.top)
    for k, depth in enumerate(model.mtp):
        top.update({f"mtp.{k}.{name}": "replicated" for name in ("enorm", "hnorm", "eh_proj")})
        top[f"mtp.{k}.layer"] = "sequence_split"
        held = dict(depth.layer.named_modules())  # a block's plan names what some blocks lack
        top.update({f"mtp.{k}.layer.{path}": kind for path, kind in plan.block.items() if path in held})
        top[f"mtp.{k}.norm"] = "gathered_norm"
    return dataclasses.replace(plan, top=top, fsdp_units=("layers", "mtp"))
