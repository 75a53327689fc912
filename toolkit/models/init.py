"""Deterministic, layout-independent parameter initialization.

``init_weights(model, seed)`` fills every parameter with a value that depends only on
(seed, parameter name): the model's ``initial_value(name, shape, generator)`` builds the
full tensor on CPU from a generator seeded with a hash of both, and it is copied in.
For a DTensor parameter (FSDP2 / tensor parallel) only this rank's shard is kept,
cut locally with ``distribute_tensor(..., src_data_rank=None)`` (no communication).

So a model built on the meta device, sharded, ``to_empty``-ed and then ``init_weights``-ed
holds exactly the values of a plain build with the same seed, whatever the world size,
the wrapping order, or the order in which parameters were created.

Cost: each parameter is drawn at one core's RNG speed (a seeded generator is sequential), so the
parameters are drawn on a pool of threads, one parameter per task (``threads``, default torch's CPU
threads): the draws release the GIL, and the values cannot depend on the thread count, since each
comes from its own (seed, name) generator. Peak extra memory = ``threads`` full-size fp32
parameters (the largest ones, e.g. the embedding). ``benchmarks/host_build.py`` measures this path
(on 2 idle cores the serial draws take about 5 s per billion parameters; the pool's gain on a
16-core host is not measured yet).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from toolkit.core.dtensor import is_dtensor
from toolkit.core.protocols import Initializable

Part = Tuple[
    Tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]
]  # (the whole tensor's shape, its cut to this rank)


def meta_embedding(num_embeddings: int, dim: int, padding_idx: Optional[int] = None) -> nn.Embedding:
    """An ``nn.Embedding`` without torch's default init, for the families' meta-device builds (``init_weights``
    fills it). There the default init is wasted work, and ``normal_`` on a meta tensor runs a Python
    reference kernel that imports torch._dynamo: a second of start-up for every command that builds a model."""
    return nn.Embedding(num_embeddings, dim, padding_idx=padding_idx, _weight=torch.empty(num_embeddings, dim))


# Module names that wrappers insert into parameter names (DDP, torch.compile,
# activation checkpointing, FSDP1); dropped so that names match the plain model's.
_WRAPPER_COMPONENTS = {"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


def canonical_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_COMPONENTS)


def parameter_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed for one parameter (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{int(seed)}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _initializing_module(model: nn.Module) -> nn.Module:
    """The (possibly wrapped) module that provides ``initial_value``."""
    for module in model.modules():
        if isinstance(module, Initializable):
            return module
    raise TypeError(f"{type(model).__name__} has no initial_value(name, shape, generator) method")


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, threads: Optional[int] = None) -> None:
    """Set every parameter (tied ones once) from ``initial_value`` and recompute buffers.

    ``threads`` (default ``torch.get_num_threads()``) parameters are drawn at a time; the values
    are the same for any number. The first parameter is drawn alone: an ``initial_value`` may set
    up shared state on its first call (fairseq models build their init twin there), and only reads
    it afterwards.
    """
    owner = _initializing_module(model)
    params: List[Tuple[str, torch.Tensor]] = []
    for name, param in owner.named_parameters():  # tied parameters are listed once
        if param.is_meta:
            raise RuntimeError(
                f"init_weights: parameter {name} is on the meta device; "
                "materialize the model first (model.to_empty(device=...))"
            )
        params.append((canonical_name(name), param))

    parts, own = _initial_parts(owner), _own_initial_values(owner)

    def fill(item: Tuple[str, torch.Tensor]) -> None:
        _fill_parameter(owner, seed, *item, part=parts.get(item[0]), value=own.get(item[0]))

    workers = min(threads or torch.get_num_threads(), len(params))
    if params:
        fill(params[0])
    if workers <= 1:
        for item in params[1:]:
            fill(item)
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="init_weights") as pool:
            for _ in pool.map(fill, params[1:]):  # re-raises a task's exception here
                pass
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()


def _initial_parts(owner: nn.Module) -> Dict[str, Part]:
    """Parameters that hold part of a larger tensor before initialization (expert parallelism under FSDP2
    places each rank's experts on the meta device): by name, the whole shape to draw and the cut to keep, so
    the values equal a plain build's. A module says so with ``initial_parts()`` ({its parameter: (shape, cut)})."""
    parts: Dict[str, Part] = {}
    for prefix, module in owner.named_modules():
        declared = getattr(module, "initial_parts", None)
        for local, part in (declared() if callable(declared) else {}).items():
            parts[canonical_name(f"{prefix}.{local}" if prefix else local)] = part
    return parts


def _own_initial_values(owner: nn.Module) -> Dict[str, Callable]:
    """Parameters a module added from outside the model initializes itself (LoRA's adapters): by name, a
    ``fn(shape, generator)`` giving the full value. A module says so with ``initial_values()`` ({its parameter:
    fn}); the model's ``initial_value`` gives every other parameter's."""
    own: Dict[str, Callable] = {}
    for prefix, module in owner.named_modules():
        declared = getattr(module, "initial_values", None)
        for local, fn in (declared() if callable(declared) else {}).items():
            own[canonical_name(f"{prefix}.{local}" if prefix else local)] = fn
    return own


@torch.no_grad()  # grad mode is per thread: the pool's threads start with it on
def _fill_parameter(
    owner: nn.Module,
    seed: int,
    name: str,
    param: torch.Tensor,
    part: Optional[Part] = None,
    value: Optional[Callable] = None,
) -> None:
    """Draw parameter ``name``'s full value from its own generator and copy (this rank's part of) it in."""
    generator = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name))
    with torch.device("cpu"):  # values come from a CPU generator, also when built under torch.device("cuda")
        if value is not None:
            full = value(param.shape, generator)
        elif part is None:
            full = owner.initial_value(name, param.shape, generator)
        else:
            whole_shape, cut = part
            full = cut(owner.initial_value(name, torch.Size(whole_shape), generator))
    if tuple(full.shape) != tuple(param.shape):
        raise RuntimeError(
            f"init_weights: initial_value({name}) has shape {tuple(full.shape)}, expected {tuple(param.shape)}"
        )
    if param.device.type == "cuda":  # a pool thread's current GPU is 0: this rank's may be another
        with torch.cuda.device(param.device):
            _copy_full_value(param, full)
    else:
        _copy_full_value(param, full)


def _copy_full_value(param: torch.Tensor, full: torch.Tensor) -> None:
    if is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        full = full.to(device=param.device, dtype=param.dtype)
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)
