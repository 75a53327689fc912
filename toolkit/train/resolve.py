"""From the command line to one resolved :class:`~toolkit.config.TrainConfig`, before any worker starts.

Some settings follow from others. Each such choice is made here, once, and logged as
one INFO line, so that ``toolkit-train data-bin/NAME --ddp-backend fully_sharded
--cpu-offload`` runs as typed:

=====================================  =================================================
not given                              chosen
=====================================  =================================================
``--arch``                             ``transformer_lm``
``--optimizer`` under ``--cpu-offload``  ``cpu_adam`` (DeepSpeed's host-memory Adam)
``--fp16``/``--bf16`` under            bf16 on a GPU that supports it, else fp16; fp32 on
``--cpu-offload``                      CPU, where offloading is a placement no-op
``--max-tokens`` and ``--batch-size``  ``--max-tokens`` max(4096, 2 x the model's positions)
=====================================  =================================================

A conflict the user wrote explicitly (``--cpu-offload --optimizer adam``) is still an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import Any, List, Optional, Sequence, Set, Tuple

import torch

from toolkit.config import composition, options
from toolkit.checkpoint.conventions import apply_conventions
from toolkit.checkpoint.model_fit import check_positions
from toolkit.config import TRAIN_CONFIGS, CommonConfig, Components, TrainConfig
from toolkit.core.errors import UserError
from toolkit.data.dictionary import reads_bos_as_context
from toolkit.evaluation import during_training as harness_training
from toolkit.compat.fairseq.flags import check_list_flags, resolve_fairseq_flags, split_list_flags
from toolkit.distributed.context_parallel import check_sequence_split
from toolkit.distributed.parallel_dims import check_expert_share, shape_from_config
from toolkit.train.arguments import DEFAULT_ARCH, OFFLOAD_OPTIMIZER, implied_selectors, parse_train_args  # noqa: F401
from toolkit.core.registry import (
    CRITERION_REGISTRY,
    LR_SCHEDULER_REGISTRY,
    OPTIMIZER_REGISTRY,
    TASK_REGISTRY,
    TOKENIZER_REGISTRY,
    Registry,
    import_all_components,
    resolve_arch,
)

logger = logging.getLogger("toolkit.resolve")  # the logger name log lines and filters already use

DEFAULT_MAX_TOKENS = 4096


def parse_train_config(
    argv: Optional[Sequence[str]] = None, prog: str = "toolkit-train", description: Optional[str] = None
) -> TrainConfig:
    """Parse ``argv`` once, resolve implied settings (logging each choice) and validate."""
    import sys

    args, explicit = parse_train_args(list(sys.argv[1:] if argv is None else argv), prog, description)
    return resolve_and_log(args, explicit)


def resolve_and_log(args: argparse.Namespace, explicit: Set[str]) -> TrainConfig:
    """:func:`resolve`, each choice made for the user logged as one INFO line."""
    import_all_components()  # parsing imported only the chosen components' options; a run has every class
    cfg, choices = resolve(args, explicit)
    for line in choices:
        logger.info(line)
    return cfg


def gpu_in_use(common: CommonConfig) -> bool:
    return torch.cuda.is_available() and not common.cpu


def resolve(args: argparse.Namespace, explicit: Set[str]) -> Tuple[TrainConfig, List[str]]:
    """The validated config and the choices made for the user (one line each)."""
    choices: List[str] = []
    if "arch" not in explicit:
        choices.append(f"--arch not given: using --arch {args.arch}")
    if args.cpu_offload and "optimizer" not in explicit:
        choices.append(f"--cpu-offload: using --optimizer {args.optimizer}")
    cfg = train_config_from_args(args)
    cfg, aliases = resolve_fairseq_flags(cfg, explicit)  # fairseq's names of our settings, before any check
    _check_conflicts(cfg, explicit)
    cfg, conventions = apply_conventions(cfg, explicit)
    for level, line in conventions:
        if level == "warning":
            logger.warning(line)
        else:
            choices.append(line)
    cfg, more = _implied_values(cfg)
    _check_values(cfg)
    warnings = _check_fp8(cfg, explicit)
    _check_layout(cfg)
    return cfg, choices + aliases + more + warnings


def _check_layout(cfg: TrainConfig) -> None:
    """The parallel layout fits the world and the model can use its axes: refused here, before any rank starts
    (``toolkit-plan`` resolves through here too, so it refuses the same layouts)."""
    world = max(cfg.distributed.distributed_world_size, int(os.environ.get("WORLD_SIZE", "1") or 1))
    shape_from_config(cfg.distributed, world, int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0))
    refused = composition.model_refusal(cfg, resolve_arch(cfg.components.arch).cls)
    if refused:
        raise UserError(refused)
    check_expert_share(cfg.distributed.expert_parallel_size, getattr(cfg.model, "moe_num_experts", 0))
    check_sequence_split(cfg.distributed.context_parallel_size, cfg.task, cfg.model, _prepends_bos(cfg))


def _check_fp8(cfg: TrainConfig, explicit: Set[str]) -> List[str]:
    """``--fp8`` and its options: what they combine with, torchao present, a GPU with float8 matmuls."""
    dist, common = cfg.distributed, cfg.common
    if not dist.fp8:
        for flag in ("fp8_recipe", "fp8_all_gather"):
            if flag in explicit:
                raise UserError(f"--{flag.replace('_', '-')} only applies with --fp8; add --fp8 or drop it")
        return []
    from toolkit.distributed import float8

    if dist.fp8_all_gather and (dist.ddp_backend != "fully_sharded" or dist.cpu_offload):
        raise UserError(
            "--fp8-all-gather casts FSDP2's all-gather to float8: it needs --ddp-backend fully_sharded "
            "with the weights on the GPU (not --cpu-offload)"
        )
    float8.float8_config(dist.fp8_recipe, dist.fp8_all_gather)  # torchao present, recipe and all-gather agree
    if gpu_in_use(common):
        float8.check_fp8_device(torch.device("cuda", torch.cuda.current_device()))
        if not dist.compile:
            return [
                "--fp8 without --compile: the float8 casts run as separate kernels and are usually slower "
                "than bf16; add --compile"
            ]
        return []
    return ["--fp8 on CPU: torch emulates the float8 matmuls (correct, slow; for checking, not for speed)"]


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Split the flat namespace into the typed sections of each chosen component."""

    def section(registry: Registry, name: Optional[str]):
        if name is None:
            return None
        entry = registry.get(name)
        return options.config_from_args(entry.config, args) if entry.config is not None else None

    args = split_list_flags(args)
    common, distributed, dataset, optimization, checkpoint, ema, lora = (
        options.config_from_args(cls, args) for cls in TRAIN_CONFIGS
    )
    arch_entry = resolve_arch(args.arch)
    return TrainConfig(
        components=Components(
            task=args.task,
            arch=args.arch,
            criterion=args.criterion,
            optimizer=args.optimizer,
            lr_scheduler=args.lr_scheduler,
            bpe=args.bpe,
            user_dir=args.user_dir,
        ),
        common=common,
        distributed=distributed,
        dataset=dataset,
        optimization=optimization,
        checkpoint=checkpoint,
        ema=ema,
        lora=lora,
        task=section(TASK_REGISTRY, args.task),
        model=options.config_from_args(arch_entry.config, args) if arch_entry.config else None,
        criterion=section(CRITERION_REGISTRY, args.criterion),
        optimizer=section(OPTIMIZER_REGISTRY, args.optimizer),
        lr_scheduler=section(LR_SCHEDULER_REGISTRY, args.lr_scheduler),
        bpe=section(TOKENIZER_REGISTRY, args.bpe),
    )


def _check_conflicts(cfg: TrainConfig, explicit: Set[str]) -> None:
    refused = composition.refusal(cfg)  # what cannot run together (docs/composition.md)
    if refused:
        raise UserError(refused)
    if cfg.distributed.model_parallel_size < 1:
        raise UserError(f"--model-parallel-size must be >= 1, got {cfg.distributed.model_parallel_size}")


def _implied_values(cfg: TrainConfig) -> Tuple[TrainConfig, List[str]]:
    """Mixed precision under --cpu-offload, fp16 under --memory-efficient-fp16, and the batch size."""
    import dataclasses

    choices: List[str] = []
    common, dataset = cfg.common, cfg.dataset
    if common.memory_efficient_fp16 and not common.fp16:
        common = dataclasses.replace(common, fp16=True)
    if cfg.distributed.cpu_offload and not (common.fp16 or common.bf16):
        if gpu_in_use(common):
            bf16 = torch.cuda.is_bf16_supported()
            common = dataclasses.replace(common, bf16=bf16, fp16=not bf16)
            choices.append(
                f"--cpu-offload: using --{'bf16' if bf16 else 'fp16'} (mixed precision on the GPU; "
                f"fp32 master shards in host memory)"
            )
        else:
            choices.append(
                "--cpu-offload: no GPU in use, so training runs in fp32 (parameters and optimizer "
                "state are already in host memory)"
            )
    dataset, more = _mixture_valid_subsets(cfg.task, dataset)
    choices += more
    if dataset.max_tokens is None and dataset.batch_size is None:
        max_tokens = max(DEFAULT_MAX_TOKENS, 2 * model_positions(cfg))
        dataset = dataclasses.replace(dataset, max_tokens=max_tokens)
        choices.append(f"--max-tokens and --batch-size not given: using --max-tokens {max_tokens}")
    return dataclasses.replace(cfg, common=common, dataset=dataset), choices


def _mixture_valid_subsets(task: Any, dataset: Any) -> Tuple[Any, List[str]]:
    """--data-mixture: each --valid-subset X is validated per source (X_NAME, for the sources that have X)."""
    spec = getattr(task, "data_mixture", None)
    if not spec:
        return dataset, []
    from toolkit.data.indexed_dataset import MMapIndexedDataset
    from toolkit.data.mixture import parse_mixture

    sources = parse_mixture(spec)
    subsets = [
        f"{v}_{s.name}"
        for v in dataset.valid_subset.split(",")
        for s in sources
        if MMapIndexedDataset.exists(os.path.join(s.path, v))
    ]
    if not subsets:
        return dataset, []  # loading --valid-subset then names the data-bins that lack it
    valid = ",".join(subsets)
    return dataclasses.replace(dataset, valid_subset=valid), [
        f"--data-mixture: validating each source and their weighted total: --valid-subset {valid}"
    ]


def _dictionary_path(task: Any) -> str:
    """The run's dict.txt: DATA's first folder, else the first --data-mixture source's."""
    data = getattr(task, "data", "") or ""
    folder = data.split(":")[0]
    if not folder and getattr(task, "data_mixture", None):
        from toolkit.data.mixture import parse_mixture

        folder = parse_mixture(task.data_mixture)[0].path
    return os.path.join(folder, "dict.txt")


def model_positions(cfg: TrainConfig) -> int:
    """The model's input length: --max-target-positions if set, else --tokens-per-sample."""
    positions = getattr(cfg.model, "max_target_positions", None)
    return int(positions or getattr(cfg.task, "tokens_per_sample", 0) or 0)


def _prepends_bos(cfg: TrainConfig) -> bool:
    """Whether ``--add-bos-token`` makes each sample a position longer (not when the data-bin's vocabulary reads
    BOS as context)."""
    return bool(getattr(cfg.task, "add_bos_token", False)) and not reads_bos_as_context(_dictionary_path(cfg.task))


def _check_values(cfg: TrainConfig) -> None:
    opt = cfg.optimization
    if opt.update_freq < 1:
        raise UserError(f"--update-freq must be >= 1, got {opt.update_freq}")
    check_list_flags(cfg)
    harness_training.check_options(cfg.dataset)
    if hasattr(cfg.task, "tokens_per_sample"):
        check_positions(
            getattr(cfg.model, "max_target_positions", None),
            cfg.task.tokens_per_sample,
            _prepends_bos(cfg),
            getattr(cfg.task, "sample_break_mode", "none"),
        )
    world = max(cfg.distributed.distributed_world_size, int(os.environ.get("WORLD_SIZE", "1") or 1))
    if getattr(cfg.model, "decoder_layerdrop", 0) > 0 and cfg.distributed.ddp_backend == "c10d" and world > 1:
        raise UserError(
            "--decoder-layerdrop with --ddp-backend c10d on several ranks: DDP waits for every "
            "parameter's gradient and a dropped layer gives none; use --ddp-backend no_c10d "
            "(fairseq's legacy_ddp) or fully_sharded"
        )
    cutoff = getattr(cfg.model, "adaptive_softmax_cutoff", None)
    if cutoff and cfg.components.criterion != "adaptive_loss":
        raise UserError(
            f"--arch {cfg.components.arch} has an adaptive softmax (--adaptive-softmax-cutoff {cutoff}): "
            f"it must be used with --criterion adaptive_loss, got --criterion {cfg.components.criterion}"
        )
    if opt.max_update <= 0 and opt.max_epoch <= 0 and opt.stop_time_hours <= 0:
        logger.warning("no --max-update, --max-epoch or --stop-time-hours: training runs until stopped")
