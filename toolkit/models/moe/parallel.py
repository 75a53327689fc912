"""The parallelism plan of the MoE family: Llama's attention split, the experts in the plan's expert slot.

Attention, norms, embeddings and the output layer take the Llama family's kinds (``llama/parallel.py``).
Each block's ``mlp`` (router and stacked experts) is named in ``experts`` with the placement ``ep_shard``
(the experts' leading dimension E cut over the ``ep`` ranks, tokens exchanged with all-to-all), which
``--expert-parallel-size`` applies (``toolkit.distributed.expert_parallel``). Tensor parallelism does not split
it (torchtitan's layout without expert tensor parallelism): every tp rank holds each of its experts whole, and
FSDP2 shards the ``mlp`` on meshes of its own (``shard_moe_replicated_over_tp``). FSDP2 shards each block as a
unit, experts included, as for the dense families.
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from toolkit.core.protocols import TensorParallelPlan
from toolkit.models.llama.config import kv_heads
from toolkit.models.llama.parallel import tensor_parallel_plan as llama_plan

EXPERTS = {"mlp": "ep_shard"}


def tensor_parallel_plan(model: nn.Module) -> TensorParallelPlan:
    cfg = model.cfg
    dense = llama_plan(model)  # its block leaves out the norms this configuration does not build
    return dataclasses.replace(
        dense,
        block={path: kind for path, kind in dense.block.items() if not path.startswith("mlp.")},
        experts=dict(EXPERTS),
        divisible=(("--decoder-kv-heads", kv_heads(cfg)), ("--decoder-attention-heads", cfg.decoder_attention_heads)),
    )
