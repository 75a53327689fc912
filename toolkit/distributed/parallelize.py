"""Build the model and apply parallelism from outside it (torchtitan's ``parallelize`` style).

The model is first built on the meta device (no memory), wrapped, then each
rank materializes only what it holds and fills it with the same values a plain
build would get for the same seed (``init_weights`` seeds per parameter name).

Order (as torchtitan's ``parallelize_llama``): ``--fp8`` swaps the blocks' Linear layers for float8
ones (``float8.py``), activation checkpointing wraps each
block, ``--compile`` compiles each (wrapped) block in place (``compile.py``), then FSDP2
``fully_shard`` each block and the root, then ``to_empty`` + ``init_weights``. DDP wraps a
materialized model.

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

The meshes, the data-parallel rank and the reduction group come from the run's one
:class:`~toolkit.distributed.parallel_dims.ParallelDims` (built here, handed to the strategy).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from toolkit import models
from toolkit.config import CommonConfig, DistributedConfig, TrainConfig
from toolkit.distributed.compile import apply_compile
from toolkit.distributed.expert_parallel import (
    ExpertGradients,
    apply_expert_parallel,
    placed_parameters,
    route_over_sequence_slices,
    shard_experts,
    shard_moe_replicated_over_tp,
)
from toolkit.distributed.float8 import apply_float8
from toolkit.distributed.parallel_dims import ParallelDims
from toolkit.distributed.strategies import AllReduceStrategy, DDPStrategy, FSDPStrategy, ParallelStrategy
from toolkit.distributed.utils import DistributedEnv
from toolkit.core import cpu_gemm
from toolkit.core.errors import UserError
from toolkit.models.init import init_weights

logger = logging.getLogger(__name__)


class DataParallelModel(torch.nn.parallel.DistributedDataParallel):
    """DDP that forwards unknown attributes (``max_positions``, ``flops_per_token``, ...) to the model."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP: what Protocol checks (``isinstance(model, FlopsCounted)``) look at."""
    return model.module if isinstance(model, DataParallelModel) else model


# --- pieces ---------------------------------------------------------------------------


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each block's activations in backward (non-reentrant, RNG state preserved).

    torch's ``checkpoint_wrapper`` keeps parameter names (state dicts drop its
    ``_checkpoint_wrapped_module`` component, as ``init_weights`` does); the recomputation takes the forward's
    matmul library (``cpu_gemm.checkpoint``).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(
            block,
            checkpoint_impl=CheckpointImpl.NO_REENTRANT,
            checkpoint_fn=cpu_gemm.checkpoint,
            preserve_rng_state=True,
        )


def reshard_after_forward(cfg: DistributedConfig) -> bool:
    return (cfg.sharding_strategy in ("full_shard", "hybrid_shard")) and not cfg.no_reshard_after_forward


def mixed_precision_policy(common: CommonConfig):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if common.fp16 or common.memory_efficient_fp16:
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    if common.bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def offload_policy(cfg: DistributedConfig, env: DistributedEnv):
    """``--cpu-offload``: FSDP2's CPUOffloadPolicy on GPU; on a CPU-only machine the state is already in host memory
    (toolkit.train.resolve says so once)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    if not cfg.cpu_offload or env.device.type != "cuda":
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def apply_fsdp(
    model: torch.nn.Module,
    mesh,
    cfg: DistributedConfig,
    common: CommonConfig,
    env: DistributedEnv,
    dims: Optional[ParallelDims] = None,
) -> None:
    """FSDP2 ``fully_shard`` on every unit the family's plan names (its blocks, bottom-up), then on the root;
    under expert parallelism (``dims.shape.ep > 1``) each unit's placed experts first, over their own mesh; under
    tensor parallelism each unit's MoE layers (replicated over tp) first, over theirs."""
    from torch.distributed.fsdp import fully_shard

    from toolkit.distributed.tensor_parallel import fsdp_units

    policies = dict(mp_policy=mixed_precision_policy(common), offload_policy=offload_policy(cfg, env))
    reshard = reshard_after_forward(cfg)
    units = fsdp_units(model)  # the family's plan says which (its blocks)
    for i, unit in enumerate(units):
        # The last unit's parameters are needed again as soon as backward starts.
        unit_reshard = reshard and i < len(units) - 1
        if dims is not None and dims.shape.tp > 1:
            shard_moe_replicated_over_tp(
                unit, dims, not cfg.no_sequence_parallel, reshard_after_forward=unit_reshard, **policies
            )
        elif dims is not None and dims.shape.ep > 1:
            shard_experts(unit, dims, reshard_after_forward=unit_reshard, **policies)
        fully_shard(unit, mesh=mesh, reshard_after_forward=unit_reshard, **policies)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, **policies)


def _move_buffers(model: torch.nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


# --- entry point -----------------------------------------------------------------------


def parallelize(
    model: torch.nn.Module, cfg: DistributedConfig, common: CommonConfig, env: DistributedEnv
) -> Tuple[torch.nn.Module, ParallelStrategy]:
    """Wrap a meta-device model as the flags ask, materialize it and initialize it on every rank."""
    check_blocks(model, cfg)
    dims = ParallelDims.from_config(cfg, env)  # the layout, validated; its meshes are built on first use
    pin = torch.cuda.is_available() and env.device.type == "cuda"
    placement = dict(offload_activations=cfg.offload_activations, pin_memory=pin, dims=dims)
    if cfg.fp8:
        apply_float8(model, cfg.fp8_recipe, cfg.fp8_all_gather)  # first: the swap is seen by AC, compile and FSDP2
    if cfg.model_parallel_size > 1:
        return _tensor_parallel(model, cfg, common, env, placement)
    if cfg.checkpoint_activations:
        apply_activation_checkpointing(model)
    if cfg.compile:  # a collective inside a block (EP's token exchange, CP's attention) stays eager between graphs
        region = eager_region(dims)
        apply_compile(model, env.device, hooks_eager=region is not None, eager_region=region)
    if cfg.ddp_backend == "fully_sharded":
        return _fully_shard(model, cfg, common, env, placement)
    model.to_empty(device=env.device)
    init_weights(model, common.seed)
    if common.memory_efficient_fp16:
        from toolkit.optim import fp16 as fp16_utils

        fp16_utils.half_model_(model)  # fp16 weights, fp32 optimizer state; before DDP builds its buckets
    expert_names, expert_params = [], []
    if dims.shape.ep > 1:
        expert_names, expert_params = apply_expert_parallel(model, dims)
        placement["expert_grads"] = ExpertGradients(expert_params, dims)
        logger.info(f"expert parallel: {len(expert_params) // 3} MoE layers' experts over {dims.shape.ep} ranks")
    if env.world_size > 1 and cfg.ddp_backend == "c10d":
        # each rank's expert shards are its own: DDP must not average them with other experts' gradients
        DataParallelModel._set_params_and_buffers_to_ignore_for_model(model, expert_names)
        model = DataParallelModel(
            model,
            device_ids=[env.local_rank] if env.device.type == "cuda" else None,
            forward_sync_buffers=False,
            gradient_as_bucket_view=True,
            find_unused_parameters=cfg.find_unused_parameters,
            bucket_cap_mb=cfg.bucket_cap_mb,
        )
        return model, DDPStrategy(**placement)
    if env.world_size > 1 and cfg.ddp_backend == "no_c10d":
        expert = {id(p) for p in expert_params}
        dense = [p for p in model.parameters() if id(p) not in expert]
        return model, AllReduceStrategy(dense, env.world_size, **placement)
    return model, ParallelStrategy(**placement)


def eager_region(dims: ParallelDims, *more: Optional[str]) -> Optional[str]:
    """What ``--compile`` leaves eager inside each block (``apply_compile``): the collective of a split, if any,
    and the caller's ``more`` (named, or None)."""
    regions = [
        name
        for name, size in (("the context-parallel attention", dims.shape.cp), ("the expert exchange", dims.shape.ep))
        if size > 1
    ]
    return " and ".join(regions + [m for m in more if m]) or None


def check_blocks(model: torch.nn.Module, cfg: DistributedConfig) -> None:
    """Options that wrap each block of ``model.layers``, refused in one line for a model without them
    (a plugin built on fairseq's base classes) instead of an AttributeError from inside the wrapping."""
    if hasattr(model, "layers"):
        return
    wanted = [
        flag
        for flag, on in (
            ("--checkpoint-activations", cfg.checkpoint_activations),
            ("--compile", cfg.compile),
            ("--ddp-backend fully_sharded", cfg.ddp_backend == "fully_sharded"),
            ("--model-parallel-size", cfg.model_parallel_size > 1),
            ("--fp8", cfg.fp8),
        )
        if on
    ]
    if wanted:
        raise UserError(
            f"{wanted[0]}: works on the blocks of model.layers, which {type(model).__name__} does not "
            f"have; drop the flag (or give the model a ModuleList of blocks named layers)"
        )


def _fully_shard(
    model: torch.nn.Module, cfg: DistributedConfig, common: CommonConfig, env: DistributedEnv, placement: dict
) -> Tuple[torch.nn.Module, ParallelStrategy]:
    if not dist.is_initialized():
        raise RuntimeError("--ddp-backend fully_sharded needs a process group (init_distributed makes one)")
    dims = placement["dims"]
    mesh = dims.fsdp_mesh
    if dims.shape.ep > 1:  # this rank's experts, kept on the meta device, are then sharded over their peers
        apply_expert_parallel(model, dims)
    apply_fsdp(model, mesh, cfg, common, env, dims)
    offloaded = cfg.cpu_offload and env.device.type == "cuda"
    model.to_empty(device="cpu" if offloaded else env.device)
    if offloaded:
        _move_buffers(model, env.device)  # only parameters/gradients/optimizer state live on the host
    init_weights(model, common.seed)
    if cfg.bf16_host_grads:
        from toolkit.distributed.host_grads import keep_grads_in_bf16

        logger.info(f"--bf16-host-grads: {keep_grads_in_bf16(model)} parameters keep their gradients in bf16")
    logger.info(
        f"fully_sharded: {cfg.sharding_strategy} on mesh {tuple(mesh.shape)} "
        f"{mesh.mesh_dim_names}, reshard after forward: {reshard_after_forward(cfg)}, "
        f"mixed precision: {mixed_precision_policy(common)}"
    )
    if dims.shape.ep > 1:
        placement["expert_grads"] = ExpertGradients(placed_parameters(model), dims, reduce=False)
        expert_mesh = dims.expert_fsdp_mesh
        replicas = f", replicated over {expert_mesh.size(0)} groups" if expert_mesh.ndim > 1 else ""
        logger.info(
            f"expert parallel: {len(placed_parameters(model)) // 3} MoE layers' experts over {dims.shape.ep} "
            f"ranks, each sharded by FSDP2 over the {dims.shape.expert_shard} ranks holding them{replicas}"
        )
    strategy = FSDPStrategy(handles_mixed_precision=bool(common.fp16 or common.bf16), **placement)
    return model, strategy


def _tensor_parallel(
    model: torch.nn.Module, cfg: DistributedConfig, common: CommonConfig, env: DistributedEnv, placement: dict
) -> Tuple[torch.nn.Module, ParallelStrategy]:
    """``--model-parallel-size M``: Megatron's split over M ranks, then FSDP2 over the W/M data-parallel groups.

    The order is torchtitan's: tensor parallelism, activation checkpointing, FSDP2, then
    materialize and initialize (the values equal a plain build's). ``c10d`` and ``no_shard``
    replicate through FSDP2 on a (W/M, 1) mesh: DDP does not take DTensor parameters. ``no_c10d`` has no
    FSDP2: its all-reduce after backward takes each rank's shards over the ranks holding the same ones.
    """
    from toolkit.distributed import tensor_parallel as tp

    if not dist.is_initialized() or env.world_size < cfg.model_parallel_size:
        raise UserError(
            f"--model-parallel-size {cfg.model_parallel_size}: each layer is split over that many ranks "
            f"and this run has {env.world_size} process(es); give --distributed-world-size "
            f"{cfg.model_parallel_size} (or a multiple), or start that many ranks with torchrun"
        )
    dims = placement["dims"]
    moe = bool(tp.model_plan(model, cfg.model_parallel_size).experts)  # MoE layers whole on every tp rank
    tp.apply_tensor_parallel(model, dims.tp_mesh, sequence_parallel=not cfg.no_sequence_parallel, loss_parallel=True)
    if dims.shape.ep > 1:  # this rank's experts, kept on the meta device, then sharded by FSDP2 over their holders
        apply_expert_parallel(model, dims)
    if not cfg.no_sequence_parallel:
        route_over_sequence_slices(model, dims.tp_mesh.get_group())
    if cfg.fp8:
        logger.info(f"--fp8 under tensor parallelism: {tp.float8_layers(model)}")
    if cfg.checkpoint_activations:
        apply_activation_checkpointing(model)
    if cfg.compile:
        # the MoE layers' own FSDP2 hooks (and the token exchange) run eagerly between graphs of the block
        region = eager_region(dims, "the MoE layers' FSDP2 hooks" if moe else None)
        apply_compile(model, env.device, hooks_eager=True, eager_region=region)
    if cfg.ddp_backend != "no_c10d":
        apply_fsdp(model, dims.fsdp_mesh, cfg, common, env, dims)
    model.to_empty(device=env.device)
    init_weights(model, common.seed)
    mesh = dims.mesh
    logger.info(
        f"tensor parallel: {dims.shape.tp} ranks per replica, {dims.data_world} data-parallel replicas, "
        f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}, sequence parallel: {not cfg.no_sequence_parallel}"
    )
    if dims.shape.ep > 1:
        placement["expert_grads"] = ExpertGradients(placed_parameters(model), dims, reduce=False)
        logger.info(
            f"expert parallel: {len(placed_parameters(model)) // 3} MoE layers' experts over {dims.shape.ep} "
            f"ranks, whole on each tp rank, each sharded by FSDP2 over the {dims.expert_holders_mesh.size()} "
            f"ranks holding them"
        )
    if cfg.ddp_backend == "no_c10d":
        return model, _tensor_parallel_all_reduce(model, dims, placement)
    return model, FSDPStrategy(
        handles_mixed_precision=bool(common.fp16 or common.bf16), loss_parallel=True, **placement
    )


def _tensor_parallel_all_reduce(model: torch.nn.Module, dims: ParallelDims, placement: dict) -> ParallelStrategy:
    """``--ddp-backend no_c10d`` under TP: no FSDP2; after backward each rank all-reduces its own shards'
    gradients over the ranks holding the same shards (the loss group: replicas x cp chunks), fairseq's legacy
    DDP per tensor-parallel slice (a layer that gets no gradient, as with LayerDrop, still takes part)."""
    if dims.loss_world == 1:
        return ParallelStrategy(loss_parallel=True, **placement)
    return AllReduceStrategy(
        model.parameters(), dims.loss_world, group=dims.loss_group, loss_parallel=True, **placement
    )


def build_parallel_model(cfg: TrainConfig, task, env: DistributedEnv) -> Tuple[torch.nn.Module, ParallelStrategy]:
    """The run's model, built on the meta device by ``toolkit.models.build_model`` (the one path from an
    architecture to a model), then wrapped, materialized and initialized."""
    with torch.device("meta"):
        model = models.build_model(cfg.components.arch, cfg.model, task)
    logger.info(model)
    total, trained = models.count_params(model)
    logger.info(f"task: {type(task).__name__}")
    logger.info(f"model: {type(model).__name__}")
    logger.info(f"num. model params: {total} (num. trained: {trained})")
    return parallelize(model, cfg.distributed, cfg.common, env)
