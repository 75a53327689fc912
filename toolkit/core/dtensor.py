"""DTensor helpers in one place: is it one, this rank's part of it, which mesh dims shard it.

FSDP2 (and tensor parallelism) turn parameters, gradients and optimizer state into
DTensors; code that works on plain tensors (DeepSpeed's CPU Adam, the host-memory
gradient norm, checkpoint accounting) goes through these.
"""

from __future__ import annotations

import sys
from typing import Any, Tuple

import torch

DTENSOR_MODULE = "torch.distributed.tensor._api"  # where DTensor is defined


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor, without importing DTensor: a process holds one only after its module was
    imported, and a single-process run never imports it (its import, with the sharding ops it registers,
    is about a second of a tiny run's start; a torch built without distributed has none either)."""
    api = sys.modules.get(DTENSOR_MODULE)
    return api is not None and isinstance(t, api.DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly DTensor) tensor; a plain tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def sharded_mesh_dims(t: torch.Tensor) -> Tuple[int, ...]:
    """The mesh dimensions over which ``t`` is split (not replicated); () for a plain tensor."""
    if not is_dtensor(t):
        return ()
    return tuple(i for i, placement in enumerate(t.placements) if placement.is_shard())


def dtensor_like(local: torch.Tensor, like: torch.Tensor, shape: Any = None, stride: Any = None) -> torch.Tensor:
    """``local`` as this rank's part of a DTensor on ``like``'s mesh and placements, left on its own device.

    Why not ``DTensor.from_local``: it moves the local tensor to the mesh's device type, and FSDP2's
    CPU offload keeps every shard (parameters, gradients, optimizer state) in host memory under a
    CUDA mesh, so a bf16 gradient or an 8-bit moment built with it would land on the GPU (and a
    gradient assignment would fail: "a gradient with device type 'cuda' to a tensor with device type
    'cpu'"). FSDP2 builds its own offloaded DTensors the same way (a spec, no device move).
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    shape = torch.Size(like.shape if shape is None else shape)
    stride = tuple(like.stride() if stride is None else stride)
    spec = DTensorSpec(like.device_mesh, tuple(like.placements), tensor_meta=TensorMeta(shape, stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)
