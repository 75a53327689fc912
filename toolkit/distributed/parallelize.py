"""Build the model and apply parallelism from outside it (torchtitan's ``parallelize`` style).

The model is first built on the meta device (no memory), wrapped, then each
rank materializes only what it holds and fills it with the same values a plain
build would get for the same seed (``init_weights`` seeds per parameter name).

Order (as torchtitan's ``parallelize_llama``): activation checkpointing wraps each
block, then FSDP2 ``fully_shard`` each (wrapped) block and the root, then
``to_empty`` + ``init_weights``. DDP wraps a materialized model.

``--ddp-backend``
    ``c10d``           DistributedDataParallel (bucketed all-reduce overlapping backward).
    ``no_c10d``        one all-reduce of all gradients after backward (fairseq's legacy DDP).
    ``fully_sharded``  FSDP2, with ``--sharding-strategy``:

    =====================  =====================================  ========================
    strategy               mesh                                   reshard after forward
    =====================  =====================================  ========================
    full_shard             1-D (W,): shard over all ranks         yes (not the last block)
    shard_grad_op          1-D (W,)                               no (ZeRO-2)
    no_shard               2-D (W, 1): replicate, shard over 1    no (DDP-like)
    hybrid_shard           2-D (W/G, G): shard within G ranks,    yes
                           replicate across groups (HSDP)
    hybrid_shard_zero2     2-D (W/G, G)                           no
    =====================  =====================================  ========================

    G is ``--shard-group-size`` (default: the ranks of one machine, ``LOCAL_WORLD_SIZE``).
    ``--no-reshard-after-forward`` turns resharding off for any strategy.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, List, Tuple

import torch
import torch.distributed as dist

from toolkit import options, registry
from toolkit.distributed import heartbeat
from toolkit.distributed.utils import DistributedEnv
from toolkit.errors import UserError
from toolkit.models.init import init_weights

logger = logging.getLogger(__name__)

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2")


@dataclass
class Parallel:
    """What the trainer needs to know about how the model was wrapped."""

    kind: str = "none"  # none | ddp | no_c10d | fsdp
    handles_mixed_precision: bool = False
    offload_activations: bool = False
    pin_memory: bool = False
    mesh: Any = None
    reducer: Any = field(default=None, repr=False)

    def grad_sync(self, model: torch.nn.Module, enabled: bool):
        """Skip gradient communication on all but the last micro-batch of an update.

        For FSDP2 the flag is read in backward, which the trainer runs after this
        context exits, so it is set here and left set (the last micro-batch sets it back).
        """
        heartbeat.progress()
        if self.kind == "ddp" and not enabled:
            return model.no_sync()
        if self.kind == "fsdp":
            model.set_requires_gradient_sync(enabled)
        elif self.kind == "no_c10d":
            self.reducer.enabled = enabled
        return contextlib.nullcontext()

    def forward_context(self):
        """Around forward: ``--offload-activations`` keeps the tensors saved for backward in host memory."""
        if self.offload_activations:
            return torch.autograd.graph.save_on_cpu(pin_memory=self.pin_memory)
        return contextlib.nullcontext()


def count_params(model: torch.nn.Module) -> Tuple[int, int]:
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly DTensor) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


class DataParallelModel(torch.nn.parallel.DistributedDataParallel):
    """DDP that forwards unknown attributes (``max_positions``, ``flops_per_token``, ...) to the model."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


class GradAllReduce:
    """``--ddp-backend no_c10d``: after backward, all-reduce all gradients (averaged), in buckets.

    Hooks on every parameter queue one callback at the end of the backward pass of a
    micro-batch whose gradient sync is enabled; gradients accumulate locally otherwise.
    """

    def __init__(self, model: torch.nn.Module, world_size: int, bucket_bytes: int = 64 << 20):
        self.params = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
        self.world_size = world_size
        self.bucket_bytes = bucket_bytes
        self.enabled = True
        self._queued = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, _param: torch.Tensor) -> None:
        if self.enabled and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)

    @torch.no_grad()
    def _reduce(self) -> None:
        self._queued = False
        for p in self.params:  # a parameter unused on this rank still takes part
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: List[torch.Tensor] = []
        size = 0
        for p in self.params:
            bucket.append(p.grad)
            size += p.grad.numel() * p.grad.element_size()
            if size >= self.bucket_bytes:
                self._all_reduce(bucket)
                bucket, size = [], 0
        if bucket:
            self._all_reduce(bucket)

    def _all_reduce(self, grads: List[torch.Tensor]) -> None:
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat.div_(self.world_size)
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


# --- pieces ---------------------------------------------------------------------------

def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each block's activations in backward (non-reentrant, RNG state preserved).

    torch's ``checkpoint_wrapper`` keeps parameter names (state dicts drop its
    ``_checkpoint_wrapped_module`` component, as ``init_weights`` does).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                             preserve_rng_state=True)


def build_mesh(args, env: DistributedEnv):
    """The data-parallel DeviceMesh of ``--sharding-strategy`` (see the module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh

    W = env.world_size
    strategy = args.sharding_strategy
    if strategy not in STRATEGIES:
        raise UserError(f"--sharding-strategy {strategy}: choose from {', '.join(STRATEGIES)}")
    device_type = env.device.type
    if strategy in ("full_shard", "shard_grad_op"):
        return init_device_mesh(device_type, (W,), mesh_dim_names=("dp_shard",))
    if strategy == "no_shard":
        return init_device_mesh(device_type, (W, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    group = args.shard_group_size or env.local_world_size or W
    if group < 1 or group > W or W % group:
        raise UserError(f"--shard-group-size {args.shard_group_size}: must divide the world size {W} "
                        f"(ranks shard within groups of this size; groups replicate)")
    return init_device_mesh(device_type, (W // group, group), mesh_dim_names=("dp_replicate", "dp_shard"))


def reshard_after_forward(args) -> bool:
    return (args.sharding_strategy in ("full_shard", "hybrid_shard")) and not args.no_reshard_after_forward


def mixed_precision_policy(args):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if args.fp16 or getattr(args, "memory_efficient_fp16", False):
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    if args.bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


_logged_cpu_offload = False


def offload_policy(args, env: DistributedEnv):
    """``--cpu-offload``: FSDP2's CPUOffloadPolicy on GPU; on a CPU-only machine the state is already in host memory."""
    global _logged_cpu_offload
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not args.cpu_offload:
        return OffloadPolicy()
    if env.device.type != "cuda":
        if not _logged_cpu_offload:
            logger.info("--cpu-offload: no GPU in use, so parameters, gradients and optimizer state are "
                        "already in host memory; nothing to offload")
            _logged_cpu_offload = True
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def apply_fsdp(model: torch.nn.Module, mesh, args, env: DistributedEnv) -> None:
    """FSDP2 ``fully_shard`` on every block (bottom-up), then on the root."""
    from torch.distributed.fsdp import fully_shard

    common = dict(mesh=mesh, mp_policy=mixed_precision_policy(args), offload_policy=offload_policy(args, env))
    reshard = reshard_after_forward(args)
    last = len(model.layers) - 1
    for i, block in enumerate(model.layers):
        # The last block's parameters are needed again as soon as backward starts.
        fully_shard(block, reshard_after_forward=reshard and i < last, **common)
    fully_shard(model, reshard_after_forward=False, **common)


def _move_buffers(model: torch.nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


# --- entry point -----------------------------------------------------------------------

def parallelize(model: torch.nn.Module, args, env: DistributedEnv) -> Tuple[torch.nn.Module, Parallel]:
    """Wrap a meta-device model as the flags ask, materialize it and initialize it on every rank."""
    ddp_backend = args.ddp_backend
    pin = torch.cuda.is_available() and env.device.type == "cuda"
    parallel = Parallel(offload_activations=bool(args.offload_activations), pin_memory=pin)
    if args.checkpoint_activations:
        apply_activation_checkpointing(model)
    if ddp_backend == "fully_sharded":
        if not dist.is_initialized():
            raise RuntimeError("--ddp-backend fully_sharded needs a process group (init_distributed makes one)")
        mesh = build_mesh(args, env)
        apply_fsdp(model, mesh, args, env)
        offloaded = args.cpu_offload and env.device.type == "cuda"
        model.to_empty(device="cpu" if offloaded else env.device)
        if offloaded:
            _move_buffers(model, env.device)  # only parameters/gradients/optimizer state live on the host
        init_weights(model, args.seed)
        parallel.kind = "fsdp"
        parallel.mesh = mesh
        parallel.handles_mixed_precision = bool(args.fp16 or args.bf16)
        logger.info(f"fully_sharded: {args.sharding_strategy} on mesh {tuple(mesh.shape)} "
                    f"{mesh.mesh_dim_names}, reshard after forward: {reshard_after_forward(args)}, "
                    f"mixed precision: {mixed_precision_policy(args)}")
        return model, parallel
    model.to_empty(device=env.device)
    init_weights(model, args.seed)
    if getattr(args, "memory_efficient_fp16", False) and env.world_size > 1:
        from toolkit.optim import fp16 as fp16_utils

        fp16_utils.half_model_(model)  # before DDP builds its buckets (the trainer does it for one process)
    if env.world_size > 1 and ddp_backend == "c10d":
        model = DataParallelModel(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None,
                                  broadcast_buffers=False, gradient_as_bucket_view=True)
        parallel.kind = "ddp"
    elif env.world_size > 1 and ddp_backend == "no_c10d":
        parallel.reducer = GradAllReduce(model, env.world_size)
        parallel.kind = "no_c10d"
    return model, parallel


def build_model(args, task, env: DistributedEnv) -> Tuple[torch.nn.Module, Parallel]:
    entry = registry.resolve_arch(args.arch)
    model_cfg = options.config_from_args(entry.config, args)
    with torch.device("meta"):
        model = entry.cls.build_model(model_cfg, task)
    logger.info(model)
    total, trained = count_params(model)
    logger.info(f"task: {type(task).__name__}")
    logger.info(f"model: {type(model).__name__}")
    logger.info(f"num. model params: {total} (num. trained: {trained})")
    if args.ddp_backend != "fully_sharded":
        for flag in ("cpu_offload", "no_reshard_after_forward"):
            if getattr(args, flag, False):
                raise UserError(f"--{flag.replace('_', '-')} requires --ddp-backend fully_sharded")
    return parallelize(model, args, env)
