"""fairseq's names and list forms of flags we already have, resolved once (called by :mod:`toolkit.train.resolve`).

=====================================  =================================================
given                                  resolved to
=====================================  =================================================
``--ddp-backend pytorch_ddp``          ``c10d`` (one INFO line)
``--ddp-backend legacy_ddp``           ``no_c10d`` (one INFO line)
``--find-unused-parameters``,          passed to DDP under ``c10d``; elsewhere accepted
``--bucket-cap-mb``                    with one INFO line saying they have no effect
``--local-rank``/``--device-id``       LOCAL_RANK from the environment wins (INFO if they differ)
no ``--distributed-world-size``        every visible GPU (one process each, spawned here), as fairseq;
                                       one process on CPU, under torchrun or under Slurm
``--amp``                              ``--fp16`` on a GPU (autocast over fp32 weights, dynamic
                                       loss scaling); fp32 on CPU
``--amp-batch-retries N``              an overflowing batch retried N times before it is skipped
                                       (toolkit.train.amp_retries); INFO "no effect" without loss scaling
``--lr 0.1,0.05``                      ``lr`` 0.1, ``lr_per_epoch`` (0.1, 0.05) for ``fixed``
``--update-freq 2,4``                  ``update_freq`` 2, ``update_freq_per_epoch`` (2, 4)
``--memory-efficient-bf16``,         see :mod:`toolkit.compat.fairseq.recipe_flags`
``--empty-cache-freq``, ...
``--ema-seed-model PATH``              the EMA starts at PATH's saved average (toolkit.train.ema); INFO "no
                                       effect" without --store-ema
=====================================  =================================================
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import List, Tuple

import torch

from toolkit.checkpoint import finetune
from toolkit.compat.fairseq.recipe_flags import resolve_recipe_flags
from toolkit.config import TrainConfig
from toolkit.distributed import launch
from toolkit.core.errors import UserError
from toolkit.config.flag_types import as_tuple

DDP_ALIASES = {"pytorch_ddp": "c10d", "legacy_ddp": "no_c10d"}
DEFAULT_BUCKET_CAP_MB = 25
# fairseq refuses a list of learning rates with these schedulers ("Cannot use a fixed learning rate schedule").
SINGLE_LR_SCHEDULERS = ("inverse_sqrt", "cosine", "reduce_lr_on_plateau", "tri_stage")


def split_list_flags(args: argparse.Namespace) -> argparse.Namespace:
    """``--lr``/``--update-freq`` as their first value plus the per-epoch tuple (a copy of ``args``)."""
    values = dict(vars(args))
    for name in ("lr", "update_freq"):
        if name in values:
            listed = as_tuple(values[name])
            values[name], values[f"{name}_per_epoch"] = listed[0], listed
    return argparse.Namespace(**values)


def resolve_fairseq_flags(cfg: TrainConfig, explicit: set) -> Tuple[TrainConfig, List[str]]:
    """The config with fairseq's aliases replaced by ours, and one line per choice made."""
    choices: List[str] = []
    dist = cfg.distributed
    if dist.ddp_backend in DDP_ALIASES:
        ours = DDP_ALIASES[dist.ddp_backend]
        choices.append(f"--ddp-backend {dist.ddp_backend}: using fairseq's equivalent here, --ddp-backend {ours}")
        dist = dataclasses.replace(dist, ddp_backend=ours)
    choices += _ddp_only_flags(dist, explicit)
    choices += _local_rank(dist)
    dist, more = _world_size(dist, cfg.common.cpu, explicit)
    choices += more
    common, more = _amp(cfg)
    choices += more + _amp_batch_retries(common, explicit)
    common, more = resolve_recipe_flags(common, dist, explicit, torch.cuda.is_available() and not common.cpu)
    choices += more
    choices += _lr_list(cfg)
    choices += _check_ema(cfg, dist)
    finetune.check_flags(cfg.checkpoint)
    return dataclasses.replace(cfg, distributed=dist, common=common), choices


def _ddp_only_flags(dist, explicit: set) -> List[str]:
    """--find-unused-parameters and --bucket-cap-mb configure DDP, which only c10d on several ranks builds."""
    given = [
        flag
        for flag, on in (
            ("--find-unused-parameters", dist.find_unused_parameters),
            ("--bucket-cap-mb", "bucket_cap_mb" in explicit),
        )
        if on
    ]
    if dist.bucket_cap_mb <= 0:
        raise UserError(f"--bucket-cap-mb must be > 0, got {dist.bucket_cap_mb}")
    if not given or dist.ddp_backend == "c10d":
        return []
    return [
        f"{' and '.join(given)}: accepted, no effect under --ddp-backend {dist.ddp_backend} "
        f"(they configure DistributedDataParallel, used by --ddp-backend c10d)"
    ]


def _local_rank(dist) -> List[str]:
    env_rank = os.environ.get("LOCAL_RANK")
    if dist.device_id is None or env_rank is None or int(env_rank) == dist.device_id:
        return []
    return [
        f"--local-rank/--device-id {dist.device_id} differs from LOCAL_RANK={env_rank} in the environment; "
        f"using LOCAL_RANK"
    ]


def _world_size(dist, cpu: bool, explicit: set):
    """fairseq's default world size, max(1, visible GPUs): spawn one process per GPU."""
    gpus = launch.default_world_size("distributed_world_size" in explicit, cpu, dist.distributed_port)
    if gpus is None:
        return dist, []
    return dataclasses.replace(dist, distributed_world_size=gpus), [
        f"--distributed-world-size not given: using all {gpus} visible GPUs (one process each, as fairseq; "
        f"--distributed-world-size 1 or --cpu for one process)"
    ]


def _amp_batch_retries(common, explicit: set) -> List[str]:
    """--amp-batch-retries: retries need --amp's loss scaling (fp16 on a GPU); say when there is none."""
    if common.amp_batch_retries < 0:
        raise UserError(f"--amp-batch-retries must be >= 0, got {common.amp_batch_retries}")
    if "amp_batch_retries" not in explicit or (common.amp and common.fp16):
        return []
    why = "without --amp" if not common.amp else "--amp runs without loss scaling here (no fp16 on a GPU)"
    return [f"--amp-batch-retries {common.amp_batch_retries}: accepted, no effect {why}: nothing overflows to retry"]


def _amp(cfg: TrainConfig):
    common = cfg.common
    if not common.amp:
        return common, []
    if common.fp16 or common.bf16:
        return common, [
            f"--amp with --{'bf16' if common.bf16 else 'fp16'}: that precision is used (--amp adds nothing)"
        ]
    if torch.cuda.is_available() and not common.cpu:
        return dataclasses.replace(common, fp16=True), [
            "--amp: fp16 autocast over fp32 weights with dynamic loss scaling (the --fp16 path)"
        ]
    return common, [
        "--amp: no GPU in use, so training runs in fp32 (fairseq's --amp is CUDA autocast; "
        "use --bf16 for reduced precision on CPU)"
    ]


def _lr_list(cfg: TrainConfig) -> List[str]:
    lrs, scheduler = cfg.optimization.lr_per_epoch, cfg.components.lr_scheduler
    if len(lrs) <= 1 or scheduler == "fixed":
        return []
    if scheduler in SINGLE_LR_SCHEDULERS:
        raise UserError(
            f"--lr {','.join(map(str, lrs))}: a list of learning rates (one per epoch) needs "
            f"--lr-scheduler fixed; --lr-scheduler {scheduler} takes one value"
        )
    return [f"--lr {','.join(map(str, lrs))}: --lr-scheduler {scheduler} uses the first value, {lrs[0]}"]


def _check_ema(cfg: TrainConfig, dist) -> List[str]:
    ema = cfg.ema
    if not ema.store_ema:
        return (
            [
                f"--ema-seed-model {ema.ema_seed_model}: accepted, no effect without --store-ema (there is no "
                f"moving average to seed)"
            ]
            if ema.ema_seed_model
            else []
        )
    if ema.ema_seed_model and not os.path.isfile(ema.ema_seed_model):
        raise UserError(
            f"--ema-seed-model {ema.ema_seed_model}: no such file; give a checkpoint trained with --store-ema"
        )
    if not 0.0 <= ema.ema_decay <= 1.0 or ema.ema_update_freq < 1:
        raise UserError(
            f"--ema-decay must be in [0, 1] and --ema-update-freq >= 1, got {ema.ema_decay} and {ema.ema_update_freq}"
        )
    return []


def check_list_flags(cfg: TrainConfig) -> None:
    bad = [v for v in cfg.optimization.update_freq_per_epoch if v < 1]
    if bad:
        raise UserError(f"--update-freq must be >= 1, got {bad[0]}")
