"""The flags that decide memory and time, read once from a resolved TrainConfig (``Setup``).

Why a separate flat record: the layout search (:mod:`toolkit.plan.search`) prices thousands of layouts and
memory settings of one run (``--model-parallel-size``, ``--cpu-offload``, ...); changing a field of a small frozen
record and planning again is simpler and cheaper than re-parsing the command line (which it does only for the
layouts it prints, to check that toolkit-train reads them back as priced).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional

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
    optimizer_options: Any  # its resolved options section (what its declared OptimizerState reads)
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
    pp: int = 1  # --pipeline-parallel-size
    pp_schedule: str = "1f1b"  # --pipeline-schedule
    pp_microbatches: int = 0  # --pipeline-microbatches (0: pp x the schedule's virtual stages per rank)
    pp_balance: Optional[str] = None  # --pipeline-balance

    @property
    def rank_sequences(self) -> float:
        """Sequences' worth of tokens a rank computes and holds activations of per micro-batch:
        ``--context-parallel-size C`` gives each rank T/C of every sequence; what it holds of the whole
        sequence (the gathered keys/values, the [T/C, T] mask) is :func:`toolkit.plan.memory.context_parallel_held`."""
        return self.batch_sequences / self.cp

    @property
    def dp(self) -> int:
        """Data-parallel ranks (of one pipeline stage)."""
        return max(1, self.world // (self.mp * self.pp))

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
            pp=self.pp,
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float32 if self.compute_bytes == 4 else torch.bfloat16

    def with_flag(self, **changes: Any) -> Setup:
        return dataclasses.replace(self, **changes)


_ALIASES = {"pytorch_ddp": "c10d", "legacy_ddp": "no_c10d"}


def data_parallel_fields(backend: str, strategy: str, tp: int, no_reshard_after_forward: bool) -> Dict[str, Any]:
    """The Setup fields that ``--ddp-backend``, ``--sharding-strategy`` and ``--no-reshard-after-forward`` decide:
    FSDP2 wraps the model under fully_sharded and under TP with any backend but no_c10d (replicating over the
    data-parallel ranks), and frees gathered parameters after each block's forward when ``--sharding-strategy`` is
    full_shard/hybrid_shard (the flag's value whatever the backend: ``parallelize.reshard_after_forward``)."""
    backend = _ALIASES.get(backend, backend)
    return dict(
        fsdp=backend == "fully_sharded" or (tp > 1 and backend != "no_c10d"),
        backend=backend,
        strategy=strategy if backend == "fully_sharded" else "no_shard",
        reshard=strategy in ("full_shard", "hybrid_shard") and not no_reshard_after_forward,
    )


def setup_from_config(cfg: Any, gpu: bool) -> Setup:
    """``cfg`` (a resolved TrainConfig) as the planner sees it; ``gpu``: the plan is for GPUs.

    On a GPU, ``--cpu-offload`` without ``--fp16``/``--bf16`` trains in bf16 (toolkit.train.resolve's
    choice there); resolved on this CPU-only machine the config says fp32, so the plan corrects it.
    """
    dist, common = cfg.distributed, cfg.common
    half = bool(common.fp16 or common.bf16 or common.memory_efficient_fp16 or (gpu and dist.cpu_offload))
    ds, tokens = cfg.dataset, sample_tokens(cfg)
    return Setup(
        world=max(1, dist.distributed_world_size),
        mp=max(1, dist.model_parallel_size),
        **data_parallel_fields(
            dist.ddp_backend, dist.sharding_strategy, dist.model_parallel_size, dist.no_reshard_after_forward
        ),
        shard_group_size=dist.shard_group_size,
        cpu_offload=dist.cpu_offload,
        optimizer=cfg.components.optimizer,
        optimizer_options=cfg.optimizer,
        bf16_host_grads=dist.bf16_host_grads,
        checkpoint=dist.checkpoint_activations,
        offload_activations=dist.offload_activations,
        sequence_parallel=not dist.no_sequence_parallel,
        compute_bytes=2 if half else 4,
        memory_efficient_fp16=common.memory_efficient_fp16,
        batch_sequences=ds.batch_size or max(1, (ds.max_tokens or tokens) // tokens),
        update_freq=cfg.optimization.update_freq,
        cp=dist.context_parallel_size,
        document_mask=bool(getattr(cfg.task, "document_attention_mask", False)),
        ep=dist.expert_parallel_size,
        pp=dist.pipeline_parallel_size,
        pp_schedule=dist.pipeline_schedule,
        pp_microbatches=dist.pipeline_microbatches,
        pp_balance=dist.pipeline_balance,
    )


def sample_tokens(cfg: Any) -> int:
    """``--tokens-per-sample`` (1024 for a task without one): what a sequence of ``--batch-size`` holds."""
    return int(getattr(cfg.task, "tokens_per_sample", 0) or 0) or 1024
