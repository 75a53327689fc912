"""The trainer's own options, grouped as fairseq groups them, with fairseq's flag names.

Components (tasks, models, optimizers, ...) declare theirs beside their code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from toolkit.core.protocols import ConfigSection
from toolkit.config.flag_types import count_or_minus_one, count_or_zero, float_list, int_list, positive_int


def opt(default, help: str, **metadata):
    return field(default=default, metadata={"help": help, **metadata})


CPU_MATMUL_CHOICES = ["auto", "onednn", "torch"]
CPU_MATMUL_HELP = (
    "fp32 matmuls on CPU: by oneDNN or by torch's BLAS (MKL); auto: whichever this CPU runs faster, "
    "measured once per machine (oneDNN is ~2x MKL on AMD CPUs; toolkit.ops)"
)


@dataclass
class CommonConfig:
    seed: int = opt(1, "random seed")
    cpu: bool = opt(False, "use CPU instead of CUDA")
    cpu_matmul: str = opt("auto", CPU_MATMUL_HELP, choices=CPU_MATMUL_CHOICES)
    log_interval: int = opt(100, "log progress every N updates", type=positive_int)
    log_format: Optional[str] = opt(
        None, "log format (default: tqdm on a terminal, else simple)", choices=["json", "simple", "tqdm", "none"]
    )
    log_file: Optional[str] = opt(None, "also write the log to this file")
    no_progress_bar: bool = opt(False, "disable the progress bar")
    tensorboard_logdir: Optional[str] = opt(None, "write TensorBoard scalars under this folder")
    wandb_project: Optional[str] = opt(
        None,
        "also log the scalars to this Weights & Biases project "
        "(pip install wandb; WANDB_MODE=offline works without a network)",
    )
    fp16: bool = opt(False, "use fp16 compute with fp32 master weights and dynamic loss scaling")
    bf16: bool = opt(False, "use bf16 compute (no loss scaling)")
    memory_efficient_fp16: bool = opt(False, "fp16 without an fp32 copy of the weights on the device")
    fp16_no_flatten_grads: bool = opt(False, "accepted for fairseq compatibility")
    fp16_init_scale: int = opt(128, "initial fp16 loss scale")
    fp16_scale_window: Optional[int] = opt(
        None, "updates without overflow before the loss scale doubles (default: 2**14 / (world size * update freq))"
    )
    fp16_scale_tolerance: float = opt(0.0, "share of overflowing updates tolerated before lowering the scale")
    threshold_loss_scale: Optional[float] = opt(None, "never lower the loss scale below this")
    min_loss_scale: float = opt(1e-4, "stop training when the loss scale falls below this")
    amp: bool = opt(
        False,
        "automatic mixed precision: fp16 autocast over fp32 weights with dynamic loss scaling "
        "(on CPU: see toolkit.train.resolve)",
    )
    plan: bool = opt(False, "log toolkit-plan's one-line memory and step-time prediction for this run at start-up")
    amp_batch_retries: int = opt(
        2,
        "under --amp: retry a batch whose gradients overflow up to N times with the "
        "lowered loss scale before skipping it",
    )
    # fairseq recipe flags (toolkit.compat.fairseq.recipe_flags says what each does here).
    memory_efficient_bf16: bool = opt(False, "fairseq's bf16 without an fp32 copy of the weights: --bf16 here")
    empty_cache_freq: int = opt(
        0, "release the CUDA caching allocator's free blocks every N updates (0: never)", type=count_or_zero
    )
    all_gather_list_size: int = opt(
        16384, "fairseq's buffer for gathering logging stats (accepted; stats are reduced as tensors here)"
    )


@dataclass
class DatasetConfig:
    num_workers: int = opt(1, "data loader worker processes", type=count_or_zero)
    max_tokens: Optional[int] = opt(None, "maximum tokens in a batch", type=positive_int)
    batch_size: Optional[int] = opt(
        None, "number of samples in a batch", aliases=("--max-sentences",), type=positive_int
    )
    required_batch_size_multiple: int = opt(8, "batch size will be a multiple of this", type=positive_int)
    train_subset: str = opt("train", "data subset to train on")
    valid_subset: str = opt("valid", "comma-separated data subsets to validate on")
    validate_interval: int = opt(1, "validate every N epochs", type=positive_int)
    validate_interval_updates: int = opt(0, "validate every N updates", type=count_or_zero)
    disable_validation: bool = opt(False, "do not validate")
    max_tokens_valid: Optional[int] = opt(
        None, "maximum tokens in a validation batch (default: --max-tokens)", type=positive_int
    )
    batch_size_valid: Optional[int] = opt(
        None, "validation batch size (default: --batch-size)", aliases=("--max-sentences-valid",), type=positive_int
    )
    skip_invalid_size_inputs_valid_test: bool = opt(
        False, "skip validation samples longer than the model's positions instead of stopping with an error"
    )
    combine_valid_subsets: bool = opt(
        False, "validate on valid, valid1, valid2, ... combined (fairseq's --combine-val)", aliases=("--combine-val",)
    )
    fixed_validation_seed: Optional[int] = opt(None, "seed the random generators with this before every validation")
    validate_after_updates: int = opt(
        0, "do not validate (nor save mid-epoch) before this many updates", type=count_or_zero
    )
    eval_harness_tasks: Optional[str] = opt(
        None,
        "lm-evaluation-harness tasks (comma-separated) to run on the "
        "master rank every --eval-harness-interval-updates; their "
        "metrics ({task}_{metric}) can be --best-checkpoint-metric",
    )
    eval_harness_interval_updates: int = opt(0, "run --eval-harness-tasks every N updates", type=count_or_zero)
    eval_harness_limit: Optional[float] = opt(None, "only the first N examples of each task (a fraction if < 1)")
    eval_harness_include_path: Optional[str] = opt(None, "folder of extra harness task YAML files")
    eval_harness_batch_size: int = opt(8, "requests per forward pass in --eval-harness-tasks", type=positive_int)


@dataclass
class OptimizationConfig:
    max_epoch: int = opt(0, "stop after this many epochs (0: no limit)", type=count_or_zero)
    max_update: int = opt(0, "stop after this many updates (0: no limit)", type=count_or_zero)
    stop_time_hours: float = opt(0.0, "stop after this many hours of training (0: no limit)")
    clip_norm: float = opt(0.0, "clip gradients to this global norm (0: no clipping)")
    update_freq: int = opt(
        1,
        "accumulate gradients over N batches before each update; a comma-separated list "
        "gives epoch e the e-th value (the last repeats). Batches are shuffled as units (fairseq), so "
        "--update-freq 2 with half the batch sees other samples together than the whole batch does: the same "
        "update as N ranks of one batch each, not as one batch of N times the size",
        type=int_list,
        metavar="N[,N...]",
    )
    lr: float = opt(
        0.25,
        "learning rate; a comma-separated list gives epoch e the e-th value under --lr-scheduler fixed",
        type=float_list,
        metavar="LR[,LR...]",
    )
    # The list forms (fairseq's): filled by toolkit.train.resolve from --update-freq / --lr; the fields above hold
    # the first value, which is what everything but the per-epoch choice uses.
    update_freq_per_epoch: Tuple[int, ...] = opt((), "--update-freq's values, one per epoch", cli=False)
    lr_per_epoch: Tuple[float, ...] = opt((), "--lr's values, one per epoch", cli=False)
    stop_min_lr: float = opt(-1.0, "stop when the learning rate falls to or below this")
    no_decay_norms_biases_embeddings: bool = opt(
        False,
        "--weight-decay skips norms, biases and embeddings (the default of the families that declare it, e.g. llama)",
    )
    decay_all_parameters: bool = opt(
        False, "--weight-decay applies to every parameter (fairseq's rule, the default of transformer_lm)"
    )


@dataclass
class CheckpointConfig:
    save_dir: str = opt("checkpoints", "where to save checkpoints")
    restore_file: str = opt(
        "checkpoint_last.pt",
        "checkpoint to resume from: the default is read in --save-dir, "
        "another path relative to the working directory; a missing "
        "file starts a fresh run",
    )
    reset_dataloader: bool = opt(False, "do not restore the data position from the checkpoint")
    reset_lr_scheduler: bool = opt(False, "do not restore the LR scheduler from the checkpoint")
    reset_meters: bool = opt(False, "do not restore the meters from the checkpoint")
    reset_optimizer: bool = opt(False, "do not restore the optimizer from the checkpoint")
    save_interval: int = opt(1, "save a checkpoint every N epochs", type=positive_int)
    save_interval_updates: int = opt(0, "save a checkpoint every N updates", type=count_or_zero)
    keep_interval_updates: int = opt(-1, "keep the last N update checkpoints", type=count_or_minus_one)
    keep_last_epochs: int = opt(-1, "keep the last N epoch checkpoints", type=count_or_minus_one)
    no_save: bool = opt(False, "do not save checkpoints")
    no_epoch_checkpoints: bool = opt(False, "only keep the last and best checkpoints")
    no_last_checkpoints: bool = opt(False, "do not write checkpoint_last.pt")
    no_save_optimizer_state: bool = opt(False, "do not save the optimizer state")
    best_checkpoint_metric: str = opt("loss", "metric that decides checkpoint_best.pt")
    maximize_best_checkpoint_metric: bool = opt(False, "a larger metric is better")
    patience: int = opt(-1, "stop after N validations without improvement (-1: never)", type=count_or_minus_one)
    keep_best_checkpoints: int = opt(
        -1,
        "keep the N best checkpoints by --best-checkpoint-metric, named "
        "checkpoint.best_{metric}_{value}.pt as fairseq names them",
        type=count_or_minus_one,
    )
    finetune_from_model: Optional[str] = opt(
        None,
        "start from this model's weights (toolkit or fairseq checkpoint) "
        "with a fresh optimizer, LR schedule, meters and data position; "
        "only when --save-dir has no checkpoint_last.pt",
    )
    use_sharded_state: bool = opt(False, "each rank saves its own shard (torch.distributed.checkpoint)")
    model_conventions: Optional[str] = opt(
        None,
        "the model's own conventions, from the checkpoint it started from (toolkit.checkpoint.conventions)",
        cli=False,
    )


@dataclass
class DistributedConfig:
    distributed_world_size: int = opt(1, "number of processes; on one machine toolkit-train spawns them")
    distributed_backend: Optional[str] = opt(
        None,
        "process group backend (default: nccl on GPU, gloo on CPU, "
        "NCCL plus gloo for host-memory shards under --cpu-offload)",
        choices=["nccl", "gloo"],
    )
    distributed_no_spawn: bool = opt(
        False, "do not spawn processes: they are started by torchrun or srun (toolkit-train never spawns under those)"
    )
    distributed_port: int = opt(-1, "port for the spawned processes' rendezvous (-1: pick a free one)")
    ddp_backend: str = opt(
        "c10d",
        "data parallel backend (fairseq's pytorch_ddp is c10d, legacy_ddp is no_c10d)",
        choices=["c10d", "fully_sharded", "no_c10d", "pytorch_ddp", "legacy_ddp"],
    )
    find_unused_parameters: bool = opt(False, "let DDP (--ddp-backend c10d) find parameters without gradients")
    bucket_cap_mb: int = opt(25, "DDP's gradient bucket size in MiB (--ddp-backend c10d)")
    device_id: Optional[int] = opt(
        None,
        "local rank given by torch.distributed.launch (the LOCAL_RANK environment variable wins)",
        aliases=("--local-rank", "--local_rank"),
    )
    sharding_strategy: str = opt(
        "full_shard",
        "how fully_sharded shards state",
        choices=["full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2"],
    )
    no_reshard_after_forward: bool = opt(False, "keep parameters gathered after forward (ZeRO-2 like)")
    shard_group_size: int = opt(0, "ranks that shard within a group for hybrid sharding (0: all local ranks)")
    cpu_offload: bool = opt(False, "keep sharded parameters, gradients and optimizer state in host memory")
    bf16_host_grads: bool = opt(
        False, "with --cpu-offload: keep the gradients in host memory in bf16 (2 bytes per parameter instead of 4)"
    )
    overlap_offload_step: bool = opt(
        False,
        "with --ddp-backend fully_sharded --optimizer cpu_adam (--cpu-offload): "
        "take the gradient norm block by block during backward and run CPU Adam "
        "block by block on a background thread while the next forward runs "
        "(the same results as the serial step)",
    )
    checkpoint_activations: bool = opt(False, "recompute each block's activations in backward")
    compile: bool = opt(
        False,
        "torch.compile each transformer block (inductor: one graph per block, or graphs "
        "around the exchange that context or expert parallelism runs inside it; the first "
        "training pass is slower while it compiles)",
    )
    fp8: bool = opt(
        False,
        "train the blocks' Linear layers in float8 (torchao; needs a GPU of compute capability "
        "8.9+ such as H100; embeddings and the output projection stay in the run's precision)",
    )
    fp8_recipe: str = opt(
        "rowwise",
        "--fp8 scaling: rowwise (a scale per row, more accurate) or tensorwise (one per tensor, faster)",
        choices=["rowwise", "tensorwise"],
    )
    fp8_all_gather: bool = opt(
        False,
        "with --fp8 --fp8-recipe tensorwise under --ddp-backend fully_sharded: "
        "all-gather the weights in float8 (half of bf16's bytes)",
    )
    offload_activations: bool = opt(False, "move saved activations to host memory until backward")
    heartbeat_timeout: int = opt(300, "seconds without progress from a rank before the run stops")
    model_parallel_size: int = opt(
        1,
        "tensor-parallel ranks per model replica (Megatron's split of every block); "
        "the world is W/M data-parallel groups of M ranks",
        aliases=("--tensor-parallel-size",),
    )
    no_sequence_parallel: bool = opt(
        False,
        "under --model-parallel-size: keep the LayerNorm/dropout activations "
        "whole on every rank instead of split over the sequence",
    )
    context_parallel_size: int = opt(
        1,
        "ranks that split each sequence of a replica (context parallelism; the "
        "model's attention must exchange keys/values across them)",
    )
    expert_parallel_size: int = opt(
        1,
        "ranks the experts of each MoE layer are spread over (tokens sent to them "
        "by all-to-all), taken from the data-parallel ranks (DDP: all of them); the "
        "model must have expert layers",
    )
    pipeline_parallel_size: int = opt(
        1,
        "pipeline stages the layers are split into (the outermost axis: each stage's ranks hold "
        "its layers, the first the embeddings, the last the final norm, the head and the loss)",
    )
    pipeline_balance: Optional[str] = opt(
        None,
        "layers per stage, fairseq's list ('[2,3]' or '2,3'; one count per stage and virtual stage); "
        "default: the split whose costliest stage (its layers' parameters, the embeddings counted on the first, "
        "the final norm and the head on the last) costs least",
    )
    pipeline_microbatches: int = opt(
        0,
        "micro-batches each batch is cut into for the pipeline (a batch of fewer rows: one row each); "
        "default 0: pp x the virtual stages per rank, the fewest that keep every stage busy at once",
    )
    pipeline_schedule: str = opt(
        "1f1b",
        "the pipeline's schedule (torch.distributed.pipelining): gpipe, 1f1b, interleaved_1f1b, zero_bubble "
        "(interleaved zero-bubble) and dualpipev take 2 virtual stages per rank (the layers cut into 2 x pp "
        "stages)",
        choices=["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "dualpipev"],
    )


@dataclass
class EMAConfig:
    """fairseq's trainer-level EMA (fairseq/models/ema): a shadow copy of the weights after each update."""

    store_ema: bool = opt(
        False, 'keep an exponential moving average of the weights, saved in the checkpoint\'s extra state under "ema"'
    )
    ema_decay: float = opt(0.9999, "decay of the moving average")
    ema_start_update: int = opt(0, "copy the weights (decay 0) until this many updates, then average")
    ema_seed_model: Optional[str] = opt(
        None,
        "start the average at the moving average saved in this checkpoint "
        "(toolkit or fairseq, trained with --store-ema)",
    )
    ema_update_freq: int = opt(1, "update the average every N updates")
    ema_fp32: bool = opt(False, "keep the average in fp32 even when the weights are fp16/bf16")


@dataclass
class LoRAConfig:
    """Low-rank adapters on the blocks' Linear layers, the rest frozen (``toolkit/models/lora.py``)."""

    lora_rank: int = opt(
        0,
        "train low-rank adapters of this rank beside the targeted Linear layers, the rest frozen (0: off)",
        type=count_or_zero,
    )
    lora_alpha: float = opt(8.0, "the adapters' scale is lora_alpha / lora_rank (peft's lora_alpha)")
    lora_dropout: float = opt(0.0, "dropout on the adapters' input (peft's lora_dropout)")
    lora_targets: str = opt(
        "all-linear",
        "the Linear layers of the blocks to adapt, by their last names (comma separated, e.g. the attention's query "
        "and value projections), or all-linear (every one; not the output layer)",
    )


TRAIN_CONFIGS = (
    CommonConfig,
    DistributedConfig,
    DatasetConfig,
    OptimizationConfig,
    CheckpointConfig,
    EMAConfig,
    LoRAConfig,
)
DEFAULT_ARCH = "transformer_lm"
OFFLOAD_OPTIMIZER = "cpu_adam"


def implied_selectors(first: Any, explicit: Set[str]) -> List[str]:
    """toolkit-train's component flags the user left out that other flags decide (they change which options
    exist): ``first`` is the parsed first pass (an ``argparse.Namespace``), ``explicit`` the options given."""
    extra: List[str] = []
    if first.arch is None:
        extra += ["--arch", DEFAULT_ARCH]
    if first.cpu_offload and "optimizer" not in explicit:
        extra += ["--optimizer", OFFLOAD_OPTIMIZER]
    return extra


@dataclass(frozen=True)
class Components:
    """Which registered components a run uses (the selector flags)."""

    task: str
    arch: str
    criterion: str
    optimizer: str
    lr_scheduler: str
    bpe: Optional[str] = None
    user_dir: Optional[str] = None


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``toolkit-train`` was asked to do, typed and resolved once (toolkit.train.resolve).

    Each component receives its own section: the distributed section goes to the parallel
    strategy, the optimizer section to the optimizer, and so on. Nothing changes it after
    resolution; values implied by others (``--optimizer`` under ``--cpu-offload``, the batch
    size, mixed precision) are already filled in.
    """

    components: Components
    common: CommonConfig
    distributed: DistributedConfig
    dataset: DatasetConfig
    optimization: OptimizationConfig
    checkpoint: CheckpointConfig
    ema: EMAConfig = dataclasses.field(default_factory=EMAConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    task: Optional[ConfigSection] = None
    model: Optional[ConfigSection] = None
    criterion: Optional[ConfigSection] = None
    optimizer: Optional[ConfigSection] = None
    lr_scheduler: Optional[ConfigSection] = None
    bpe: Optional[ConfigSection] = None

    def sections(self) -> Tuple[Any, ...]:
        return (
            self.common,
            self.distributed,
            self.dataset,
            self.optimization,
            self.checkpoint,
            self.ema,
            self.lora,
            self.task,
            self.model,
            self.criterion,
            self.optimizer,
            self.lr_scheduler,
            self.bpe,
        )

    def to_dict(self) -> Dict[str, Any]:
        """The flat ``{option: value}`` dict that checkpoints store (fairseq's ``cfg``), plain values only."""
        flat: Dict[str, Any] = {}
        for section in self.sections():
            if section is not None:
                flat.update(plain_values(dataclasses.asdict(section)))
        flat.update(plain_values(dataclasses.asdict(self.components)))
        return flat

    def summary(self) -> str:
        """The run's components and every option that differs from its default, section by section: the start-up
        line a reader can take in (the whole configuration is the checkpoint's ``cfg``, hundreds of options)."""
        chosen = {k: v for k, v in dataclasses.asdict(self.components).items() if v is not None}
        parts = [", ".join(f"{k}={v}" for k, v in chosen.items())]
        for name in (f.name for f in dataclasses.fields(self) if f.name != "components"):
            changed = non_default_values(getattr(self, name))
            if changed:
                parts.append(f"{name}: " + ", ".join(f"{k}={v!r}" for k, v in changed.items()))
        return "options (those not at their defaults): " + " | ".join(parts)


def non_default_values(section: Any) -> Dict[str, Any]:
    """A config dataclass's fields whose values differ from the field's default."""
    changed: Dict[str, Any] = {}
    for option in dataclasses.fields(section) if section is not None else ():
        if option.default is not dataclasses.MISSING:
            default = option.default
        elif option.default_factory is not dataclasses.MISSING:
            default = option.default_factory()
        else:
            default = dataclasses.MISSING
        value = getattr(section, option.name)
        if value != default:
            changed[option.name] = value
    return changed


def plain_values(values: Dict[str, Any]) -> Dict[str, Any]:
    """Only plain values survive, so a checkpoint holding them loads with ``weights_only=True``."""
    plain = (str, int, float, bool, type(None))
    return {
        k: v
        for k, v in values.items()
        if isinstance(v, plain) or (isinstance(v, (list, tuple)) and all(isinstance(x, plain) for x in v))
    }
