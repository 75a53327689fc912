"""The global L2 norm of the gradients, fast where they live in host memory.

On a GPU this is torch's ``get_total_norm``. For gradients in host memory (``--cpu``,
or FSDP2 shards under ``--cpu-offload``) torch's CPU ``linalg.vector_norm`` runs on one
thread: on a 16-core host it read offloaded fp32 gradients at about 10 GB/s, 1.1 s of a
3.1 s ``transformer_lm_gpt3_2_7`` update on an H100. There the sum of squares is taken
with ``torch.dot(g, g)`` (BLAS, on every thread) and, for FSDP2's DTensors, all-reduced
over the mesh dimensions that shard the gradients (not those that replicate them).

``torch.dot`` accumulates the squares in fp32 without rescaling, so values beyond about
1e19 overflow where ``vector_norm`` would not: the caller treats a non-finite norm as
"look again" (see ``Trainer._normalize_and_clip``), never as proof of an overflow.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from toolkit.distributed.dtensor import is_dtensor, local_tensor

_CHUNK = 1 << 22


def sum_of_squares(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of plain tensors, as a float64 CPU scalar; fp32 on the CPU through BLAS."""
    total = torch.zeros((), dtype=torch.float64)
    for t in tensors:
        if t.numel() == 0:
            continue
        if t.device.type == "cpu" and t.dtype == torch.float32:
            # fp32 dots of 4M elements summed in fp64: about 1e-5 relative (a single 26M-element dot
            # was off by 2e-4, torch's vector_norm by 1.4e-3).
            for v in t.reshape(-1).split(_CHUNK):  # views when contiguous
                total += torch.dot(v, v).double()
        else:
            total += torch.linalg.vector_norm(t, 2, dtype=torch.float32).double().cpu() ** 2
    return total


def total_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all ``grads`` together (DTensors: over every shard), a 0-dim float32 tensor."""
    if not grads:
        return torch.zeros(())
    if all(local_tensor(g).device.type != "cpu" for g in grads):
        norm = torch.nn.utils.get_total_norm(list(grads), foreach=True)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    groups: Dict[Tuple, List[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if is_dtensor(g) else (None, ())
        groups.setdefault(key, []).append(local_tensor(g))
    total = torch.zeros((), dtype=torch.float64)
    for (mesh, placements), local in groups.items():
        squares = sum_of_squares(local)
        for dim, placement in enumerate(placements):
            # Shards (and partial sums) add up across this mesh dimension; replicas do not.
            if (placement.is_shard() or placement.is_partial()) and mesh.size(dim) > 1:
                dist.all_reduce(squares, group=mesh.get_group(dim))
        total += squares
    return total.sqrt().float()
