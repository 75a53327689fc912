"""The tensor-parallel plan of a rotary decoder family (``common/rotary_decoder.py``), torchtitan's ``apply_tp``
split: the family states its block as data (module path -> kind, the ``BLOCK`` of its ``parallel.py``); the
model's own modules are the same in every such family and are named here.

``toolkit.distributed.tensor_parallel`` applies a plan, looking each kind up in its registry
(``register_tp_style``); ``toolkit-plan`` counts the split from the same plan. FSDP2 shards each block as a
unit (``fsdp_units``). The split:

==========================  ===========================  =====================================
module                      kind (parameter placement)   what a rank computes
==========================  ===========================  =====================================
``embed_tokens``            vocab_embedding (Shard(0))   lookups of its V/M tokens, all-reduce
``q_proj``                  column (Shard(0))            its H/M query heads
``k_proj``, ``v_proj``      column (Shard(0))            its G/M key/value heads (G % M == 0)
``o_proj``, ``down_proj``   row (Shard(1))               partial sums, reduce-scatter over T
``gate_proj``, ``up_proj``  column (Shard(0))            its F/M hidden units
RMSNorms                    norm (Replicate)             its T/M positions (sequence parallel)
``q_norm``, ``k_norm``      head_norm (Replicate)        its heads' features (QK-norm per head)
``q_norm``, ``k_norm``      projection_norm (Shard(0))   its heads' features, the RMS over all
(over all heads)                                         heads (OLMo 2: squares all-reduced)
``self_attn`` (``sinks``)   attention_sinks (Shard(0))   its H/M heads' sink logits (gpt-oss)
``output_projection``       output (Shard(0); or the     its V/M logits, the loss taken with
                            tied embedding)              ``loss_parallel`` (no gather)
==========================  ===========================  =====================================

Query head h uses key/value head h // (H/G); with contiguous blocks of H/M query heads and G/M
key/value heads per rank, every rank holds exactly the key/value heads its query heads read, so
attention needs no communication. q/k/v are separate parameters (no fused layout to redistribute),
so the state dict is the plain model's. Biases go with their layer's split: q/k/v's with their heads' rows,
``o_proj``'s whole on every rank, added once to the reduced output (torch's row-parallel split). A per-head
vector of the attention module itself (gpt-oss's ``sinks`` [H]) is Shard(0) as ``q_proj``'s heads, so each rank's
softmax rows meet their own heads' sinks. The rotary tables are replicated buffers; a block takes
(x, cos, sin) and only x is cut over the sequence, as the column-parallel projections gather the
sequence first. These families have no dropout, so no per-rank random streams are needed.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch.nn as nn

from toolkit.core.protocols import TensorParallelPlan
from toolkit.models.common.options import kv_heads


ATTENTION = {
    "self_attn.q_proj": "column",
    "self_attn.k_proj": "column",
    "self_attn.v_proj": "column",
    "self_attn.o_proj": "row",
}
"""A block's attention projections and their kinds (a family's ``BLOCK`` holds them)."""
PROJECTIONS = {
    "self_attn.q_proj": "column",
    "self_attn.k_proj": "column",
    "self_attn.v_proj": "column",
    "mlp.gate_proj": "column",
    "mlp.up_proj": "column",
    "self_attn.o_proj": "row",
    "mlp.down_proj": "row",
}
"""A block's attention and gated MLP projections and their kinds."""


def decoder_plan(
    model: nn.Module,
    block: Dict[str, str],
    experts: Optional[Dict[str, str]] = None,
    divisible: Optional[Tuple[Tuple[str, int], ...]] = None,
) -> TensorParallelPlan:
    """The plan of ``model`` with the family's ``block``; what M must divide defaults to the key/value heads
    first (the usual culprit), the query heads and the MLP's width."""
    cfg = model.cfg
    top: Dict[str, str] = {"embed_tokens": "vocab_embedding", "norm": "norm"}
    if model.output_projection is not None:
        top["output_projection"] = "output"
    top["layers.0"] = "sequence_split"
    attention = model.layers[0].self_attn
    if getattr(attention, "q_norm", None) is not None:  # per head: Qwen3, Gemma 3; over all heads: OLMo 2
        norm = "head_norm" if attention.qk_norm_per_head else "projection_norm"
        block = {**block, "self_attn.q_norm": norm, "self_attn.k_norm": norm}
    if getattr(attention, "sinks", None) is not None:  # gpt-oss: one logit per query head, split with the heads
        block = {**block, "self_attn": "attention_sinks"}
    return TensorParallelPlan(
        top=top,
        block=dict(block),
        hidden="norm",
        positions=cfg.max_target_positions,
        block_inputs=3,
        padding_idx=model.padding_idx,
        fsdp_units=("layers",),
        experts=dict(experts or {}),
        divisible=divisible
        or (
            ("--decoder-kv-heads", kv_heads(cfg)),
            ("--decoder-attention-heads", cfg.decoder_attention_heads),
            ("--decoder-ffn-embed-dim", cfg.decoder_ffn_embed_dim),
        ),
    )
