"""The tensor-parallel plan of the Llama family, torchtitan's ``apply_tp`` split, named module by module.

``toolkit.distributed.tensor_parallel`` applies it, looking each kind up in its registry (``register_tp_style``);
``toolkit-plan`` counts the split from the same plan. FSDP2 shards each block as a unit (``fsdp_units``);
there are no experts (``experts`` empty). The split:

==========================  ===========================  =====================================
module                      kind (parameter placement)   what a rank computes
==========================  ===========================  =====================================
``embed_tokens``            vocab_embedding (Shard(0))   lookups of its V/M tokens, all-reduce
``q_proj``                  column (Shard(0))            its H/M query heads
``k_proj``, ``v_proj``      column (Shard(0))            its G/M key/value heads (G % M == 0)
``o_proj``, ``down_proj``   row (Shard(1))               partial sums, reduce-scatter over T
``gate_proj``, ``up_proj``  column (Shard(0))            its F/M hidden units
RMSNorms                    norm (Replicate)             its T/M positions (sequence parallel)
``output_projection``       output (Shard(0); or the     its V/M logits, the loss taken with
                            tied embedding)              ``loss_parallel`` (no gather)
==========================  ===========================  =====================================

Query head h uses key/value head h // (H/G); with contiguous blocks of H/M query heads and G/M
key/value heads per rank, every rank holds exactly the key/value heads its query heads read, so
attention needs no communication. q/k/v are separate parameters (no fused layout to redistribute),
so the state dict is the plain model's. The rotary tables are replicated buffers; a block takes
(x, cos, sin) and only x is cut over the sequence, as the column-parallel projections gather the
sequence first. The family has no dropout, so no per-rank random streams are needed.
"""

from __future__ import annotations

from typing import Dict

import torch.nn as nn

from toolkit.core.protocols import TensorParallelPlan
from toolkit.models.llama.config import kv_heads

BLOCK = {
    "self_attn.q_proj": "column",
    "self_attn.k_proj": "column",
    "self_attn.v_proj": "column",
    "mlp.gate_proj": "column",
    "mlp.up_proj": "column",
    "self_attn.o_proj": "row",
    "mlp.down_proj": "row",
    "input_layernorm": "norm",
    "post_attention_layernorm": "norm",
    "post_feedforward_layernorm": "norm",
    "pre_feedforward_layernorm": "norm",
}


def tensor_parallel_plan(model: nn.Module) -> TensorParallelPlan:
    """Key/value heads first among the sizes M must divide: the usual culprit."""
    cfg = model.cfg
    top: Dict[str, str] = {"embed_tokens": "vocab_embedding", "norm": "norm"}
    if model.output_projection is not None:
        top["output_projection"] = "output"
    top["layers.0"] = "sequence_split"
    unused_norm = (
        {"input_layernorm"} if cfg.norm_after_sublayer else set() if cfg.gemma_norms else {"post_feedforward_layernorm"}
    )
    if not cfg.gemma_norms:
        unused_norm.add("pre_feedforward_layernorm")
    return TensorParallelPlan(
        top=top,
        block={path: kind for path, kind in BLOCK.items() if path not in unused_norm},
        hidden="norm",
        positions=cfg.max_target_positions,
        block_inputs=3,
        padding_idx=model.padding_idx,
        fsdp_units=("layers",),
        experts={},
        divisible=(
            ("--decoder-kv-heads", kv_heads(cfg)),
            ("--decoder-attention-heads", cfg.decoder_attention_heads),
            ("--decoder-ffn-embed-dim", cfg.decoder_ffn_embed_dim),
        ),
    )
