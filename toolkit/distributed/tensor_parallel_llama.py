"""Tensor parallelism for the Llama family (``toolkit.models.llama``), torchtitan's ``apply_tp`` plan.

On a tensor-parallel mesh of M ranks, with the styles of ``toolkit.distributed.tensor_parallel``:

==========================  ===========================  =====================================
module                      parameter placement          what a rank computes
==========================  ===========================  =====================================
``embed_tokens``            rows (vocabulary) Shard(0)   lookups of its V/M tokens, all-reduce
``q_proj``                  Shard(0) (column-parallel)   its H/M query heads
``k_proj``, ``v_proj``      Shard(0) (column-parallel)   its G/M key/value heads (G % M == 0)
``o_proj``, ``down_proj``   Shard(1) (row-parallel)      partial sums, reduce-scatter over T
``gate_proj``, ``up_proj``  Shard(0) (column-parallel)   its F/M hidden units
RMSNorms                    Replicate                    its T/M positions (sequence parallel)
``output_projection``       Shard(0) (or the tied        its V/M logits, the loss taken with
                            embedding)                   ``loss_parallel`` (no gather)
==========================  ===========================  =====================================

Query head h uses key/value head h // (H/G); with contiguous blocks of H/M query heads and G/M
key/value heads per rank, every rank holds exactly the key/value heads its query heads read, so
attention needs no communication. q/k/v are separate parameters (no fused layout to redistribute),
so the state dict is the plain model's. The rotary tables are replicated buffers; each block gets
the rows of all T positions, as the column-parallel projections gather the sequence first. The
family has no dropout, so no per-rank random streams are needed.
"""
from __future__ import annotations

from typing import Dict

import torch.nn as nn

from toolkit.distributed.tensor_parallel import (_ColumnParallelLinear, _gather_logits_hook, _pad_sequence_hooks,
                                                 _ReplicatedParallel, _replicate_hidden_hook, _swap_class_style,
                                                 _VocabParallelEmbedding)
from toolkit.core.errors import UserError
from toolkit.models.llama.config import kv_heads


def check_divisible(model: nn.Module, M: int, sequence_parallel: bool = True) -> None:
    """One line naming the size that M does not divide (key/value heads first: the usual culprit)."""
    cfg = model.cfg
    sizes = [("--decoder-kv-heads", kv_heads(cfg)), ("--decoder-attention-heads", cfg.decoder_attention_heads),
             ("--decoder-ffn-embed-dim", cfg.decoder_ffn_embed_dim)]
    if sequence_parallel:
        sizes.append(("--tokens-per-sample (max target positions)", cfg.max_target_positions))
    for flag, value in sizes:
        if value % M:
            raise UserError(f"{flag} {value}: must be divisible by --model-parallel-size {M} (each rank holds "
                            f"whole heads and an equal share); choose a model parallel size that divides it")


def block_plan(sequence_parallel: bool) -> Dict[str, object]:
    """Column-parallel q/k/v and gate/up, row-parallel o_proj and down_proj; norms on T/M positions."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

    layout = Shard(1) if sequence_parallel else Replicate()  # the residual stream's
    plan: Dict[str, object] = {f"self_attn.{name}": _swap_class_style(_ColumnParallelLinear, 0, input_layout=layout)
                               for name in ("q_proj", "k_proj", "v_proj")}
    plan.update({f"mlp.{name}": _swap_class_style(_ColumnParallelLinear, 0, input_layout=layout)
                 for name in ("gate_proj", "up_proj")})
    row = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    plan.update({"self_attn.o_proj": row, "mlp.down_proj": row})
    norm = SequenceParallel(use_local_output=True) if sequence_parallel else _ReplicatedParallel.style()
    plan.update({"input_layernorm": norm, "post_attention_layernorm": norm})
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = True,
                          loss_parallel: bool = True) -> nn.Module:
    """Shard a ``LlamaLanguageModel`` (meta or materialized) over ``tp_mesh``; the contract of
    ``toolkit.distributed.tensor_parallel.apply_tensor_parallel`` (call before checkpointing and FSDP2)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, SequenceParallel,
                                                   parallelize_module)

    M = tp_mesh.size()
    check_divisible(model, M, sequence_parallel)
    top: Dict[str, object] = {"embed_tokens": _swap_class_style(_VocabParallelEmbedding, 0),
                              "norm": SequenceParallel(use_local_output=True) if sequence_parallel
                              else _ReplicatedParallel.style()}
    if model.output_projection is not None:
        top["output_projection"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                                   use_local_output=False)
    if sequence_parallel:  # the replicated embedding output is cut into sequence chunks; cos/sin stay whole
        top["layers.0"] = PrepareModuleInput(input_layouts=(Replicate(), None, None),
                                             desired_input_layouts=(Shard(1), None, None), use_local_output=True)
    parallelize_module(model, tp_mesh, top, src_data_rank=None)
    if sequence_parallel:
        _pad_sequence_hooks(model, M, model.padding_idx)
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel), src_data_rank=None)
    model.norm.register_forward_hook(_replicate_hidden_hook(tp_mesh, sequence_parallel))
    if not loss_parallel:
        model.register_forward_hook(_gather_logits_hook)
    return model
