"""Worker for tests/integration/test_parallel_dims.py: the run's ParallelDims built on 4 gloo ranks.

For each layout, every rank builds its ParallelDims from the same flags ``parallelize`` reads, asks
for what its consumers ask (data rank and world, the loss group, the FSDP / TP / CP / EP meshes, the
experts' FSDP2 mesh, their holders under TP), sums
its rank over each group with a real collective, and rank 0 gathers all ranks' answers.
"""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from toolkit.distributed.parallel_dims import DP_AXES, EXPERT_PEERS

LAYOUTS = {
    "full_shard": dict(ddp_backend="fully_sharded"),
    "hybrid_2x2": dict(ddp_backend="fully_sharded", sharding_strategy="hybrid_shard", shard_group_size=2),
    "c10d": dict(),
    "c10d_tp2": dict(model_parallel_size=2),
    "c10d_tp2_ep2": dict(model_parallel_size=2, expert_parallel_size=2),
    "full_shard_tp2_ep2": dict(ddp_backend="fully_sharded", model_parallel_size=2, expert_parallel_size=2),
    "full_shard_cp2_ep4": dict(ddp_backend="fully_sharded", context_parallel_size=2, expert_parallel_size=4),
    "full_shard_ep2": dict(ddp_backend="fully_sharded", expert_parallel_size=2),
    "hybrid_2x2_ep2": dict(
        ddp_backend="fully_sharded", sharding_strategy="hybrid_shard", shard_group_size=2, expert_parallel_size=2
    ),
    "no_shard_ep2": dict(ddp_backend="fully_sharded", sharding_strategy="no_shard", expert_parallel_size=2),
}


def _ranks(group) -> list:
    """The global ranks of ``group`` (None: the default group, all ranks)."""
    return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)


def _summed_rank(group) -> int:
    """This rank summed over ``group`` with an all-reduce: the group is real, not only a list of ranks."""
    t = torch.tensor([dist.get_rank()], dtype=torch.int64)
    dist.all_reduce(t, group=group)
    return int(t.item())


def _describe(dims) -> Dict:
    out = dict(
        data=(dims.data_rank, dims.data_world),
        loss_world=dims.loss_world,
        loss_ranks=_ranks(dims.group(*DP_AXES)),
        loss_sum=_summed_rank(dims.group(*DP_AXES)),
        mesh=None,
    )
    if dims.shape.needs_mesh:
        fsdp, mesh = dims.mesh(*DP_AXES), dims.mesh(*DP_AXES, "tp")
        out.update(mesh=(tuple(mesh.shape), mesh.mesh_dim_names), fsdp=(tuple(fsdp.shape), fsdp.mesh_dim_names))
    for axis, size in (("tp", dims.shape.tp), ("cp", dims.shape.cp), ("ep", dims.shape.ep)):
        if size > 1:
            group = dims.group(axis)
            out[axis] = (_ranks(group), _summed_rank(group))
    if dims.shape.ep > 1:
        peers = dims.group(*EXPERT_PEERS)
        out["expert_peers"] = _ranks(peers), _summed_rank(peers)
    if dims.shape.ep > 1 and dims.shape.fsdp and dims.shape.tp == 1:
        mesh = dims.mesh(*EXPERT_PEERS)  # FSDP2's mesh of the experts: the ranks holding the same ones
        if mesh.ndim == 1:
            out["expert_fsdp"] = (_ranks(mesh.get_group()), _summed_rank(mesh.get_group()))
        else:  # HSDP: (replicate, shard), each axis's group
            out["expert_fsdp"] = (
                tuple(mesh.shape),
                mesh.mesh_dim_names,
                [(_ranks(mesh.get_group(d)), _summed_rank(mesh.get_group(d))) for d in range(2)],
            )
    if dims.shape.ep > 1 and dims.shape.tp > 1:
        group = dims.group(*EXPERT_PEERS, "tp")  # experts whole on every tp rank: their holders
        out["expert_holders"] = (_ranks(group), _summed_rank(group))
    return out


def worker_layouts(rank: int, world_size: int, out_dir: str) -> Dict:
    from toolkit.config import DistributedConfig
    from toolkit.distributed.parallel_dims import ParallelDims
    from toolkit.distributed.utils import DistributedEnv

    env = DistributedEnv(rank=rank, world_size=world_size, local_world_size=world_size)
    result = {}
    for name, flags in LAYOUTS.items():
        dims = ParallelDims.from_config(DistributedConfig(**flags), env)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, _describe(dims))
        result[name] = gathered
    return result
