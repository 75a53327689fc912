"""``--expert-parallel-size P``: each MoE layer's stacked experts spread over P data-parallel ranks.

Every rank builds and initializes the whole model (the same values as one process), then
:func:`apply_expert_parallel` keeps E/P consecutive experts of each layer on each rank of the ``ep`` group
(``GroupedExperts.place``; the tokens travel by all-to-all, ``toolkit.models.blocks.moe``). Those shards
differ between the ranks of one ep group, so DDP leaves them out of its all-reduce; instead
:func:`expert_grad_reducer` sums them over the ranks that hold the same experts (``ep_peers``, world / P
ranks) and divides by the world size, as DDP averages the rest: each shard's gradient already holds the
contributions of the tokens of all P ranks, brought back by the exchange's backward.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from toolkit.distributed.parallel_dims import ParallelDims
from toolkit.models.blocks.moe import EXPERT_PROJECTIONS, GroupedExperts


def apply_expert_parallel(model: torch.nn.Module, dims: ParallelDims) -> Tuple[List[str], List[torch.nn.Parameter]]:
    """Place every MoE layer's experts on this rank's share; (their parameter names, the parameters)."""
    group, rank = dims.ep_mesh.get_group(), dims.ep_mesh.get_local_rank()
    names, params = [], []
    for prefix, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            module.place(group, rank, dims.shape.ep)
            names += [f"{prefix}.{name}" for name in EXPERT_PROJECTIONS]
            params += [getattr(module, name) for name in EXPERT_PROJECTIONS]
    return names, params


def expert_grad_reducer(params: List[torch.nn.Parameter], dims: ParallelDims):
    """The all-reduce of the expert gradients over the ranks holding the same experts, averaged over the world."""
    from toolkit.distributed.strategies import GradAllReduce

    return GradAllReduce(params, dims.shape.world, group=dims.expert_peers_group)
