"""Build the model and apply parallelism from outside it: one sequence for every layout (torchtitan's
``parallelize_llama``).

The model is built on the meta device (no memory); each step below changes it when its axis or feature is on
and is a no-op otherwise; then each rank materializes only what it holds and fills it with the values a plain
build gets for the same seed (``init_weights`` seeds per parameter name). First, a model whose parameters,
split over every rank, exceed each rank's memory is refused in one line (:func:`check_fits_memory`), before
the allocator is asked for it:

0. ``--pipeline-parallel-size``: the model keeps only this rank's stages' layers (``pipeline.py``), so every step
   below wraps, materializes and initializes only those; the strategy gets the stages' schedule.
1. ``--lora-rank``: the targeted Linear layers of the blocks get low-rank adapters and every other parameter is
   frozen (``toolkit/models/lora.py``); checkpointing, compile and FSDP2 then wrap the adapted blocks as any other.
2. ``--fp8``: the blocks' Linear layers become float8 ones (``float8.py``), which every later step sees.
3. ``--model-parallel-size``: Megatron's split by the family's plan (``tensor_parallel.py``); under sequence
   parallelism each MoE layer routes its tp rank's positions (``route_over_sequence_slices``).
4. ``--expert-parallel-size``: each MoE layer keeps this rank's experts (``expert_parallel.py``).
5. ``--context-parallel-size``: nothing to wrap: the strategy gives each rank its chunks of the batch
   (``ParallelStrategy.shard_sample``) and the attention exchanges keys/values (``context_parallel.py``).
6. ``--checkpoint-activations``: each block recomputes its activations in backward.
7. ``--compile``: each (wrapped) block is compiled in place (``compile.py``).
8. FSDP2 (``--ddp-backend fully_sharded``, and ``c10d`` under TP: DDP does not take DTensor parameters):
   ``fully_shard`` on each block, its placed experts (or under TP its MoE layers) first over meshes of their
   own, then the root.
9. Materialize (in host memory under ``--cpu-offload`` on a GPU) and ``init_weights``, once.
10. The gradients' synchronization: FSDP2's own, DDP's (``c10d``), or one all-reduce after backward
   (``no_c10d``, fairseq's legacy DDP; under TP over the ranks holding the same shards); the placed experts'
   by :class:`~toolkit.distributed.expert_parallel.ExpertGradients`.

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

    G is ``--shard-group-size`` (default: the ranks of one machine, ``LOCAL_WORLD_SIZE``, of one pipeline stage).
    ``--no-reshard-after-forward`` turns resharding off for any strategy.

The meshes, the data-parallel rank and the reduction group come from the run's one
:class:`~toolkit.distributed.parallel_dims.ParallelDims` (built here, handed to the strategy), asked for by
axis names. What cannot combine is refused before any rank starts (``toolkit/config/composition.py``).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from toolkit import models
from toolkit.config import CommonConfig, DistributedConfig, LoRAConfig, TrainConfig
from toolkit.distributed.compile import apply_compile
from toolkit.distributed.expert_parallel import (
    ExpertGradients,
    apply_expert_parallel,
    placed_names,
    placed_parameters,
    route_over_sequence_slices,
    shard_experts,
    shard_moe_replicated_over_tp,
)
from toolkit.distributed.float8 import apply_float8
from toolkit.distributed.parallel_dims import DP_AXES, EXPERT_PEERS, TP, ParallelDims
from toolkit.distributed.pipeline import Pipeline, build_pipeline
from toolkit.distributed.strategies import AllReduceStrategy, DDPStrategy, FSDPStrategy, ParallelStrategy
from toolkit.distributed.utils import DistributedEnv
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


# --- the sequence ----------------------------------------------------------------------


def parallelize(
    model: torch.nn.Module,
    cfg: DistributedConfig,
    common: CommonConfig,
    env: DistributedEnv,
    lora: Optional[LoRAConfig] = None,
) -> Tuple[torch.nn.Module, ParallelStrategy]:
    """Wrap a meta-device model as the flags ask, materialize it and initialize it on every rank (module docstring:
    the steps, each a no-op when its axis or feature is off)."""
    lora = lora or LoRAConfig()
    check_blocks(model, cfg, lora)
    check_fits_memory(model, env, common.cpu)
    dims = ParallelDims.from_config(cfg, env)  # the layout, validated
    if dims.shape.needs_mesh:  # its meshes and groups, built here on every rank at once (a collective)
        if not dist.is_initialized():
            raise RuntimeError(f"{dims.shape.describe()}: needs a process group (init_distributed makes one)")
        dims.mesh("world")
    if lora.lora_rank > 0:
        adapt_with_lora(model, lora)
    total, trained = models.count_params(model)  # the whole model, before any rank keeps its part
    logger.info(f"num. model params: {total} (num. trained: {trained})")
    stages = build_pipeline(model, cfg, dims) if dims.shape.pp > 1 else None  # this rank's layers only
    if cfg.fp8:
        apply_float8(model, cfg.fp8_recipe, cfg.fp8_all_gather)
    if dims.shape.tp > 1:
        _tensor_parallel(model, cfg, dims)
    if dims.shape.ep > 1:  # on the meta device: init_weights draws each whole stack and keeps this rank's part
        apply_expert_parallel(model, dims)
    if cfg.checkpoint_activations:
        apply_activation_checkpointing(model)
    if cfg.compile:
        region = eager_region(
            dims, "the MoE layers' FSDP2 hooks" if dims.shape.tp > 1 and _has_experts(model) else None
        )
        apply_compile(model, env.device, hooks_eager=dims.shape.tp > 1 or region is not None, eager_region=region)
    if dims.shape.fsdp:
        apply_fsdp(model, cfg, common, env, dims)
    materialize(model, cfg, common, env, dims)
    log_layout(model, cfg, common, dims)
    model, strategy = synchronized(model, cfg, common, env, dims)
    if stages is not None:
        strategy.pipeline = Pipeline(model, stages, dims, cfg.pipeline_schedule, cfg.pipeline_microbatches)
        log_pipeline(strategy.pipeline)
    return model, strategy


# --- the steps -------------------------------------------------------------------------


def _tensor_parallel(model: torch.nn.Module, cfg: DistributedConfig, dims: ParallelDims) -> None:
    """``--model-parallel-size M``: Megatron's split over the tp ranks; the MoE layers stay whole on each (their
    experts placed next), routing this rank's positions under sequence parallelism."""
    from toolkit.distributed import tensor_parallel as tp

    sequence_parallel = not cfg.no_sequence_parallel
    pad = dims.shape.pp == 1  # a pipeline pads its batches to a multiple of the tp size itself (pipeline.py)
    tp.apply_tensor_parallel(
        model, dims.mesh(TP), sequence_parallel=sequence_parallel, loss_parallel=True, pad_sequence=pad
    )
    if sequence_parallel:
        route_over_sequence_slices(model, dims.group(TP))
    if cfg.fp8:
        logger.info(f"--fp8 under tensor parallelism: {tp.float8_layers(model)}")


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each block's activations in backward (non-reentrant, RNG state preserved).

    torch's ``checkpoint_wrapper`` keeps parameter names (state dicts drop its
    ``_checkpoint_wrapped_module`` component, as ``init_weights`` does).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for i, block in enumerate(model.layers):
        if block is None:  # another pipeline stage's layer
            continue
        model.layers[i] = checkpoint_wrapper(
            block,
            checkpoint_impl=CheckpointImpl.NO_REENTRANT,
            preserve_rng_state=True,
        )


def eager_region(dims: ParallelDims, *more: Optional[str]) -> Optional[str]:
    """What ``--compile`` leaves eager inside each block (``apply_compile``): the collective of a split, if any,
    and the caller's ``more`` (named, or None); None when nothing is."""
    regions = [
        name
        for name, size in (("the context-parallel attention", dims.shape.cp), ("the expert exchange", dims.shape.ep))
        if size > 1
    ]
    return " and ".join(regions + [m for m in more if m]) or None


def _has_experts(model: torch.nn.Module) -> bool:
    """Under TP: the family's plan places experts (its MoE layers are whole on every tp rank, sharded by FSDP2
    apart, whose hooks run eagerly between the compiled graphs of a block)."""
    return bool(model.tensor_parallel_plan().experts)


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

    if not _offloaded(cfg, env):
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def _offloaded(cfg: DistributedConfig, env: DistributedEnv) -> bool:
    return cfg.cpu_offload and env.device.type == "cuda"


def apply_fsdp(
    model: torch.nn.Module, cfg: DistributedConfig, common: CommonConfig, env: DistributedEnv, dims: ParallelDims
) -> None:
    """FSDP2 ``fully_shard`` on every unit the family's plan names (its blocks, bottom-up), then on the root, over
    the data-parallel mesh (``DP_AXES``); under tensor parallelism each unit's MoE layers (replicated over tp)
    first, over theirs; under expert parallelism each unit's placed experts first, over their own."""
    from torch.distributed.fsdp import fully_shard

    from toolkit.distributed.tensor_parallel import fsdp_units

    mesh = dims.mesh(*DP_AXES)
    policies = dict(mp_policy=mixed_precision_policy(common), offload_policy=offload_policy(cfg, env))
    reshard = reshard_after_forward(cfg)
    units = fsdp_units(model)  # the family's plan says which (its blocks)
    for i, unit in enumerate(units):
        # The last unit's parameters are needed again as soon as backward starts; under a pipeline every unit's
        # are, by the micro-batches in flight (torchtitan keeps them gathered too)
        unit_reshard = reshard and i < len(units) - 1 and dims.shape.pp == 1
        if dims.shape.tp > 1:
            shard_moe_replicated_over_tp(
                unit, dims, not cfg.no_sequence_parallel, reshard_after_forward=unit_reshard, **policies
            )
        elif dims.shape.ep > 1:
            shard_experts(unit, dims, reshard_after_forward=unit_reshard, **policies)
        fully_shard(unit, mesh=mesh, reshard_after_forward=unit_reshard, **policies)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, **policies)


def materialize(
    model: torch.nn.Module, cfg: DistributedConfig, common: CommonConfig, env: DistributedEnv, dims: ParallelDims
) -> None:
    """Allocate what this rank holds (FSDP2's offloaded shards in host memory, the buffers on the device) and
    fill it as one process would; the weights' own precision where no wrapper casts them."""
    offloaded = _offloaded(cfg, env)
    model.to_empty(device="cpu" if offloaded else env.device)
    if offloaded:  # only parameters/gradients/optimizer state live on the host
        for module in model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.device != env.device:
                    module._buffers[name] = buf.to(env.device)
    init_weights(model, common.seed)
    if common.memory_efficient_fp16 and not dims.shape.fsdp:
        from toolkit.optim import fp16 as fp16_utils

        fp16_utils.half_model_(model)  # fp16 weights, fp32 optimizer state; before DDP builds its buckets
    if cfg.bf16_host_grads:
        from toolkit.distributed.host_grads import keep_grads_in_bf16

        logger.info(f"--bf16-host-grads: {keep_grads_in_bf16(model)} parameters keep their gradients in bf16")


def synchronized(
    model: torch.nn.Module, cfg: DistributedConfig, common: CommonConfig, env: DistributedEnv, dims: ParallelDims
) -> Tuple[torch.nn.Module, ParallelStrategy]:
    """The model as the trainer calls it and the strategy that synchronizes its gradients: FSDP2's, DDP's, or one
    all-reduce after backward over the ranks holding the same parameters (``DP_AXES``); the placed experts'
    gradients apart (:class:`ExpertGradients`, reduced by FSDP2 itself under it)."""
    shape = dims.shape
    pin = torch.cuda.is_available() and env.device.type == "cuda"
    placement: Dict[str, Any] = dict(
        offload_activations=cfg.offload_activations, pin_memory=pin, dims=dims, loss_parallel=shape.tp > 1
    )
    if shape.ep > 1:
        placement["expert_grads"] = ExpertGradients(placed_parameters(model), dims, reduce=not shape.fsdp)
    if shape.fsdp:
        return model, FSDPStrategy(handles_mixed_precision=bool(common.fp16 or common.bf16), **placement)
    if shape.loss_world == 1:
        return model, ParallelStrategy(**placement)
    if cfg.ddp_backend == "c10d" and shape.pp == 1:  # a pipeline's stages run the model piecewise: no DDP wrapper
        # each rank's expert shards are its own: DDP must not average them with other experts' gradients
        DataParallelModel._set_params_and_buffers_to_ignore_for_model(model, placed_names(model))
        model = DataParallelModel(
            model,
            device_ids=[env.local_rank] if env.device.type == "cuda" else None,
            forward_sync_buffers=False,
            gradient_as_bucket_view=True,
            find_unused_parameters=cfg.find_unused_parameters,
            bucket_cap_mb=cfg.bucket_cap_mb,
        )
        return model, DDPStrategy(**placement)
    # no_c10d: under TP each rank all-reduces its own shards' gradients over the ranks holding the same shards,
    # fairseq's legacy DDP per tensor-parallel slice (a layer that gets no gradient, as with LayerDrop, takes part)
    experts = {id(p) for p in placed_parameters(model)}
    dense = [p for p in model.parameters() if id(p) not in experts]
    return model, AllReduceStrategy(dense, shape.loss_world, group=dims.group(*DP_AXES), **placement)


def log_layout(model: torch.nn.Module, cfg: DistributedConfig, common: CommonConfig, dims: ParallelDims) -> None:
    """One INFO line per split that is on: the tensor-parallel mesh, FSDP2's sharding, the experts' placement."""
    shape = dims.shape
    if shape.tp > 1:
        mesh = dims.mesh(*DP_AXES, TP)
        logger.info(
            f"tensor parallel: {shape.tp} ranks per replica, {dims.data_world} data-parallel replicas, "
            f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}, sequence parallel: {not cfg.no_sequence_parallel}"
        )
    elif cfg.ddp_backend == "fully_sharded":
        mesh = dims.mesh(*DP_AXES)
        logger.info(
            f"fully_sharded: {cfg.sharding_strategy} on mesh {tuple(mesh.shape)} "
            f"{mesh.mesh_dim_names}, reshard after forward: {reshard_after_forward(cfg) and shape.pp == 1}, "
            f"mixed precision: {mixed_precision_policy(common)}"
        )
    if shape.ep > 1:
        logger.info(
            f"expert parallel: {len(placed_parameters(model)) // 3} MoE layers' experts over {shape.ep} ranks"
            + _expert_sharding(dims)
        )


def log_pipeline(pipeline: Pipeline) -> None:
    """One INFO line: this rank's stages, their layers, the schedule and its micro-batches."""
    stages = "; ".join(
        f"stage {s.index}: layers {s.layers[0]}-{s.layers[-1]}"
        + (" + embeddings" if s.first else "")
        + (" + norm, head, loss" if s.last else "")
        for s in pipeline.specs
    )
    logger.info(
        f"pipeline parallel: {pipeline.pp} ranks along pp, {pipeline.schedule_name} with {pipeline.microbatches} "
        f"micro-batches per batch; this rank's {stages}"
    )


def _expert_sharding(dims: ParallelDims) -> str:
    """How FSDP2 shards the placed experts (nothing under DDP and no_c10d)."""
    shape = dims.shape
    if shape.tp > 1:
        holders = dims.mesh(*EXPERT_PEERS, TP, flat=True).size()
        return f", whole on each tp rank, each sharded by FSDP2 over the {holders} ranks holding them"
    if not shape.fsdp:
        return ""
    mesh = dims.mesh(*EXPERT_PEERS)
    replicas = f", replicated over {mesh.size(0)} groups" if mesh.ndim > 1 else ""
    return f", each sharded by FSDP2 over the {shape.expert_shard} ranks holding them{replicas}"


def check_blocks(model: torch.nn.Module, cfg: DistributedConfig, lora: Optional[LoRAConfig] = None) -> None:
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
            ("--lora-rank", lora is not None and lora.lora_rank > 0),
        )
        if on
    ]
    if wanted:
        raise UserError(
            f"{wanted[0]}: works on the blocks of model.layers, which {type(model).__name__} does not "
            f"have; drop the flag (or give the model a ModuleList of blocks named layers)"
        )


def check_fits_memory(model: torch.nn.Module, env: DistributedEnv, cpu: bool) -> None:
    """The parameters, split over every rank, fit this machine's memory (its share per local rank, and the GPU's
    under CUDA): an impossible size (``--moe-num-experts 1000000000``) is one line before the allocator is asked
    for it, not a traceback about a size in bytes after minutes of start-up."""
    from toolkit.core import preflight

    unique = list({id(p): p for p in model.parameters()}.values())
    memory = preflight.physical_memory() // max(1, env.local_world_size)
    if torch.cuda.is_available() and not cpu:
        memory += torch.cuda.get_device_properties(env.device).total_memory
    preflight.check_fits_memory(
        "the model",
        sum(p.numel() for p in unique),
        sum(p.numel() * p.element_size() for p in unique),
        env.world_size,
        memory,
        "lower its sizes (--decoder-layers, --decoder-embed-dim, --moe-num-experts, ...); toolkit-plan shows what fits",
    )


def adapt_with_lora(model: torch.nn.Module, lora: LoRAConfig) -> None:
    """``--lora-rank``: low-rank adapters beside the targeted Linear layers, every other parameter frozen."""
    from toolkit.models.lora import apply_lora

    adapted = apply_lora(model, lora.lora_rank, lora.lora_alpha, lora.lora_dropout, lora.lora_targets)
    leaves = sorted({name.rsplit(".", 1)[-1] for name in adapted})
    logger.info(
        f"LoRA: rank {lora.lora_rank}, alpha {lora.lora_alpha:g}, dropout {lora.lora_dropout:g} on {len(adapted)} "
        f"Linear layers ({', '.join(leaves)}); every other parameter frozen"
    )


def build_parallel_model(cfg: TrainConfig, task, env: DistributedEnv) -> Tuple[torch.nn.Module, ParallelStrategy]:
    """The run's model, built on the meta device by ``toolkit.models.build_model`` (the one path from an
    architecture to a model), then wrapped, materialized and initialized."""
    with torch.device("meta"):
        model = models.build_model(cfg.components.arch, cfg.model, task)
    logger.info(model)
    logger.info(f"task: {type(task).__name__}")
    logger.info(f"model: {type(model).__name__}")
    return parallelize(model, cfg.distributed, cfg.common, env, cfg.lora)
