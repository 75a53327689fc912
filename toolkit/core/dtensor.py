"""DTensor helpers in one place: is it one, this rank's part of it, which mesh dims shard it.

FSDP2 (and tensor parallelism) turn parameters, gradients and optimizer state into
DTensors; code that works on plain tensors (DeepSpeed's CPU Adam, the host-memory
gradient norm, checkpoint accounting) goes through these.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch


def is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly DTensor) tensor; a plain tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def sharded_mesh_dims(t: torch.Tensor) -> Tuple[int, ...]:
    """The mesh dimensions over which ``t`` is split (not replicated); () for a plain tensor."""
    if not is_dtensor(t):
        return ()
    return tuple(i for i, placement in enumerate(t.placements) if placement.is_shard())
