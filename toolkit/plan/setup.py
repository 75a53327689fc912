"""The flags that decide memory and time, read once from a resolved TrainConfig (``Setup``).

Why a separate flat record: the planner tries flag changes to find the first one that makes a
run fit (``--checkpoint-activations``, ``--cpu-offload``, ...); changing a field of a small frozen
record and planning again is simpler and cheaper than re-parsing the command line.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from toolkit.distributed.parallel_dims import ParallelShape, parallel_shape


@dataclass(frozen=True)
class Setup:
    world: int
    mp: int  # --model-parallel-size
    fsdp: bool  # FSDP2 wraps the model (fully_sharded, or c10d under TP; not no_c10d)
    backend: str  # c10d | no_c10d | fully_sharded
    strategy: str  # --sharding-strategy
    shard_group_size: int
    reshard: bool  # FSDP2 frees gathered parameters after each block's forward
    cpu_offload: bool
    optimizer: str
    adam_state_precision: str
    fp16_adam_stats: bool
    bf16_host_grads: bool
    checkpoint: bool
    offload_activations: bool
    sequence_parallel: bool
    compute_bytes: int  # 2 under --fp16/--bf16, else 4
    memory_efficient_fp16: bool
    batch_sequences: int  # sequences per micro-batch and data-parallel rank
    update_freq: int
    cp: int = 1  # --context-parallel-size
    document_mask: bool = False  # --document-attention-mask: the CP mask has a row block per sequence
    ep: int = 1  # --expert-parallel-size
    muon_momentum_bytes: int = 4  # --optimizer muon's momentum per matrix value (--muon-momentum-dtype)

    @property
    def rank_sequences(self) -> float:
        """Sequences' worth of tokens a rank computes and holds activations of per micro-batch:
        ``--context-parallel-size C`` gives each rank T/C of every sequence; what it holds of the whole
        sequence (the gathered keys/values, the [T/C, T] mask) is :func:`toolkit.plan.memory.context_parallel_held`."""
        return self.batch_sequences / self.cp

    @property
    def dp(self) -> int:
        return max(1, self.world // self.mp)

    @property
    def bucketed_all_reduce(self) -> bool:
        """``--ddp-backend no_c10d`` with replicas to sum over: one bucketed all-reduce after backward (under TP each
        rank's own shards, over the ranks holding the same ones)."""
        return self.backend == "no_c10d" and not self.fsdp and self.dp > 1

    def layout(self, gpus_per_node: int) -> ParallelShape:
        """The parallel layout toolkit-train would build (the same validation: a layout it refuses raises here)."""
        return parallel_shape(
            self.world,
            "fully_sharded" if self.fsdp else self.backend,
            self.strategy,
            self.shard_group_size,
            min(gpus_per_node, self.world),
            tp=self.mp,
            cp=self.cp,
            ep=self.ep,
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float32 if self.compute_bytes == 4 else torch.bfloat16

    def with_flag(self, **changes: Any) -> Setup:
        return dataclasses.replace(self, **changes)


_ALIASES = {"pytorch_ddp": "c10d", "legacy_ddp": "no_c10d"}


def _reshard(dist: Any) -> bool:
    return dist.sharding_strategy in ("full_shard", "hybrid_shard") and not dist.no_reshard_after_forward


def setup_from_config(cfg: Any, gpu: bool) -> Setup:
    """``cfg`` (a resolved TrainConfig) as the planner sees it; ``gpu``: the plan is for GPUs.

    On a GPU, ``--cpu-offload`` without ``--fp16``/``--bf16`` trains in bf16 (toolkit.train.resolve's
    choice there); resolved on this CPU-only machine the config says fp32, so the plan corrects it.
    """
    dist, common, opt = cfg.distributed, cfg.common, cfg.optimizer
    backend = _ALIASES.get(dist.ddp_backend, dist.ddp_backend)
    half = bool(common.fp16 or common.bf16 or common.memory_efficient_fp16 or (gpu and dist.cpu_offload))
    tokens = int(getattr(cfg.task, "tokens_per_sample", 0) or 0) or 1024
    ds = cfg.dataset
    batch = ds.batch_size or max(1, (ds.max_tokens or tokens) // tokens)
    return Setup(
        world=max(1, dist.distributed_world_size),
        mp=max(1, dist.model_parallel_size),
        fsdp=backend == "fully_sharded" or (dist.model_parallel_size > 1 and backend != "no_c10d"),
        backend=backend,
        strategy=dist.sharding_strategy if backend == "fully_sharded" else "no_shard",
        shard_group_size=dist.shard_group_size,
        reshard=_reshard(dist),
        cpu_offload=dist.cpu_offload,
        optimizer=cfg.components.optimizer,
        adam_state_precision=getattr(opt, "adam_state_precision", "fp32") if opt is not None else "fp32",
        fp16_adam_stats=bool(getattr(opt, "fp16_adam_stats", False)) if opt is not None else False,
        bf16_host_grads=dist.bf16_host_grads,
        checkpoint=dist.checkpoint_activations,
        offload_activations=dist.offload_activations,
        sequence_parallel=not dist.no_sequence_parallel,
        compute_bytes=2 if half else 4,
        memory_efficient_fp16=common.memory_efficient_fp16,
        batch_sequences=batch,
        update_freq=cfg.optimization.update_freq,
        cp=dist.context_parallel_size,
        document_mask=bool(getattr(cfg.task, "document_attention_mask", False)),
        ep=dist.expert_parallel_size,
        muon_momentum_bytes=2 if getattr(opt, "muon_momentum_dtype", "fp32") == "bf16" else 4,
    )
