"""The tensor-parallel plan of ``TransformerLanguageModel``: Megatron's split, named module by module.

``toolkit.distributed.tensor_parallel`` applies it, looking each kind up in its registry (``register_tp_style``);
``toolkit-plan`` counts the split from the same plan. FSDP2 shards each block as a unit (``fsdp_units``);
there are no experts (``experts`` empty). The split:

==========================  ===========================  =====================================
module                      kind (parameter placement)   what a rank computes
==========================  ===========================  =====================================
``embed_tokens``            vocab_embedding (Shard(0))   lookups of its V/M tokens, all-reduce
``self_attn.qkv_proj``      fused_qkv (Shard(0) of       q, k and v of its H/M heads
                            ``[q | k | v]``)
``out_proj``, ``fc2``       row (Shard(1))               partial sums, reduce-scatter over T
``fc1``                     column (Shard(0))            its F/M hidden units
LayerNorms                  norm (Replicate)             its T/M positions (sequence parallel)
``output_projection``       output (Shard(0); or the     its V/M logits, the loss taken with
                            tied embedding)              ``loss_parallel`` (no gather)
positions, ``project_in``   replicated                   all positions, on the replicated input
``project_out_dim``         replicated_weights           the replicated hidden state
==========================  ===========================  =====================================

Dropout inside a block acts on this rank's heads (attention) and hidden units (between fc1 and
fc2): those regions draw per-rank masks. The adaptive input and softmax and
``--layernorm-embedding`` have no split: ``toolkit/config/composition.py`` refuses them under TP.
"""

from __future__ import annotations

from typing import Dict

import torch.nn as nn

from toolkit.core.protocols import TensorParallelPlan

BLOCK = {
    "self_attn_layer_norm": "norm",
    "self_attn": "sequence_input",
    "self_attn.qkv_proj": "fused_qkv",
    "self_attn.out_proj": "row",
    "final_layer_norm": "norm",
    "fc1": "column",
    "fc2": "row",
}


def tensor_parallel_plan(model: nn.Module) -> TensorParallelPlan:
    """The plan of this model's modules; those it lacks (tied output, no learned positions) are left out."""
    top: Dict[str, str] = {"embed_tokens": "vocab_embedding"}
    optional = {
        "output_projection": "output",
        "embed_positions": "replicated",
        "project_in_dim": "replicated",
        "project_out_dim": "replicated_weights",
        "layer_norm": "norm",
    }
    top.update({name: kind for name, kind in optional.items() if getattr(model, name) is not None})
    top["layers.0"] = "sequence_split"  # the replicated embedding output is cut into sequence chunks there
    cfg = model.cfg
    last = "layer_norm" if model.layer_norm is not None else f"layers.{len(model.layers) - 1}"
    return TensorParallelPlan(
        top=top,
        block=dict(BLOCK),
        hidden=last,
        positions=cfg.max_target_positions,
        padding_idx=model.padding_idx,
        divisible=(
            ("--decoder-attention-heads", cfg.decoder_attention_heads),
            ("--decoder-ffn-embed-dim", cfg.decoder_ffn_embed_dim),
        ),
        sharded_dropout=(("self_attn", "self_attn"), ("fc1", "fc2")),
        fsdp_units=("layers",),
        experts={},
    )
