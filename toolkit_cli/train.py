"""toolkit-train: train a language model, fairseq-style.

    toolkit-train data-bin/wikitext-103 --task language_modeling --arch transformer_lm \
        --optimizer adam --lr 0.0005 --max-tokens 2048 --max-update 1000
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import List, Optional, Sequence, Tuple

import torch

from toolkit import options
from toolkit.checkpoint import checkpoint_utils as ckpt, compat, resume, stale_files
from toolkit.config import TRAIN_CONFIGS
from toolkit.distributed import launch
from toolkit.distributed.parallelize import build_model
from toolkit.distributed.utils import DistributedEnv, all_ranks_agree, all_reduce_sums, init_distributed
from toolkit.errors import UserError
from toolkit.logging import metrics, progress_bar, throughput
from toolkit.logging.setup import setup_logging
from toolkit.registry import TASK_REGISTRY
from toolkit.trainer import Trainer

logger = logging.getLogger("toolkit_cli.train")


def validate_args(args) -> None:
    """Conflicting or missing flags, caught before any work starts."""
    if args.arch is None:
        raise UserError("--arch is required (e.g. --arch transformer_lm); see toolkit-train --help")
    if args.max_tokens is None and args.batch_size is None:
        raise UserError("give --max-tokens or --batch-size to size the batches")
    if args.fp16 and args.bf16:
        raise UserError("--fp16 and --bf16 conflict; choose one")
    if args.memory_efficient_fp16 and args.bf16:
        raise UserError("--memory-efficient-fp16 and --bf16 conflict; choose one")
    if args.memory_efficient_fp16:
        args.fp16 = True
    if args.cpu_offload and args.ddp_backend != "fully_sharded":
        raise UserError("--cpu-offload requires --ddp-backend fully_sharded")
    if args.cpu_offload and args.optimizer != "cpu_adam":
        raise UserError(f"--cpu-offload requires --optimizer cpu_adam (the offloaded shards are updated in host "
                        f"memory by DeepSpeed's CPU Adam), got --optimizer {args.optimizer}; add --optimizer cpu_adam")
    if args.cpu_offload and not (args.fp16 or args.bf16):
        raise UserError("--cpu-offload requires mixed precision (fp32 master shards in host memory, fp16/bf16 "
                        "compute on the device); add --fp16 (or --bf16)")
    if args.update_freq < 1:
        raise UserError(f"--update-freq must be >= 1, got {args.update_freq}")
    compat.check_positions(vars(args).get("max_target_positions"), args.tokens_per_sample, args.add_bos_token,
                           args.sample_break_mode)
    if args.max_update <= 0 and args.max_epoch <= 0 and args.stop_time_hours <= 0:
        logger.warning("no --max-update, --max-epoch or --stop-time-hours: training runs until stopped")


def main(args) -> None:
    env = init_distributed(args)
    setup_logging(args.log_file, rank=env.rank)
    validate_args(args)
    logger.info(args)
    torch.manual_seed(args.seed)

    trainer = build_trainer(args, env, [args.train_subset, *args.valid_subset.split(",")])
    task, model = trainer.task, trainer.model
    metrics.log_wall_start()
    metrics.set_throughput_tracker(throughput_tracker(args, model, env, trainer.compute_dtype))
    logger.info(f"training on {env.world_size} devices ({env.device.type})")
    logger.info(f"max tokens per device = {args.max_tokens} and max sentences per device = {args.batch_size}")

    if env.is_master:  # before anything is saved: leftovers of saves that crashed
        stale_files.remove_stale_temp_files(args.save_dir)
    best = ckpt.BestTracker(args.maximize_best_checkpoint_metric)
    itr_state = ckpt.load_latest(args, trainer, best)
    epoch_itr = train_iterator(args, task, env, epoch=itr_state.get("epoch", 1) if itr_state else 1)
    if itr_state and not args.reset_dataloader:
        epoch_itr.load_state_dict(itr_state)
    done = itr_state is not None and resume.finished_reason(
        os.path.basename(ckpt.restore_path(args)), resume.StopCriteria.from_args(args), trainer.num_updates,
        epoch_itr.next_epoch_idx, trainer.get_lr())
    if done:  # a restart of a finished run: no step, no file written
        if env.is_master:
            print(done, flush=True)
        return

    train_meter = metrics.StopwatchMeter()
    train_meter.start()
    start_time = time.time()
    while epoch_itr.next_epoch_idx <= (args.max_epoch or math.inf):
        valid_losses, should_stop = train_epoch(args, trainer, task, epoch_itr, env, best, start_time)
        if should_stop:
            break
        trainer.lr_step(epoch_itr.epoch, valid_losses[0])
        epoch_itr = train_iterator(args, task, env, epoch=epoch_itr.next_epoch_idx)
    train_meter.stop()
    logger.info(f"done training in {train_meter.sum:.1f} seconds")


def build_trainer(args, env: DistributedEnv, splits: Sequence[str] = ()) -> Trainer:
    """The task (with ``splits`` loaded), the model wrapped as the flags ask, its criterion and the Trainer."""
    task_entry = TASK_REGISTRY.get(args.task)
    task = task_entry.cls.setup_task(options.config_from_args(task_entry.config, args))
    for split in splits:
        task.load_dataset(split)
    model, parallel = build_model(args, task, env)
    return Trainer(args, task, model, task.build_criterion(args), env, parallel)


def throughput_tracker(args, model, env: DistributedEnv, dtype: torch.dtype) -> throughput.ThroughputTracker:
    """tokens/s per device and MFU against the device's peak (measured once on CPU)."""
    flops = model.flops_per_token(args.tokens_per_sample) if hasattr(model, "flops_per_token") else 0.0
    peak = throughput.peak_flops(env.device, dtype)
    logger.info(f"peak {dtype} throughput of this device: {peak / 1e9:.1f} GFLOP/s (for MFU)")
    return throughput.ThroughputTracker(flops, peak, env.world_size)


def train_iterator(args, task, env: DistributedEnv, epoch: int):
    return task.get_batch_iterator(
        task.dataset(args.train_subset), max_tokens=args.max_tokens, batch_size=args.batch_size,
        required_batch_size_multiple=args.required_batch_size_multiple, seed=args.seed,
        num_shards=env.world_size, shard_id=env.rank, num_workers=args.num_workers, epoch=epoch)


def valid_iterator(args, task, subset: str, env: DistributedEnv):
    return task.get_batch_iterator(
        task.dataset(subset), max_tokens=args.max_tokens_valid or args.max_tokens,
        batch_size=args.batch_size_valid or args.batch_size,
        required_batch_size_multiple=args.required_batch_size_multiple, seed=args.seed,
        num_shards=env.world_size, shard_id=env.rank, num_workers=args.num_workers, epoch=1)


def make_progress(args, iterator, env: DistributedEnv, epoch: int, prefix: Optional[str] = None):
    return progress_bar.progress_bar(
        iterator, log_format=args.log_format, log_interval=args.log_interval, epoch=epoch, prefix=prefix,
        tensorboard_logdir=args.tensorboard_logdir if env.is_master else None,
        default_log_format="simple" if args.no_progress_bar else "tqdm")


def train_epoch(args, trainer: Trainer, task, epoch_itr, env: DistributedEnv, best: ckpt.BestTracker,
                start_time: float) -> Tuple[List[Optional[float]], bool]:
    """The loop: one ``train_step`` per group of ``--update-freq`` batches; log, validate, save."""
    itr = epoch_itr.next_epoch_itr(shuffle=True)
    trainer.lr_scheduler.step_begin_epoch(epoch_itr.epoch)
    progress = make_progress(args, progress_bar.GroupedIterator(itr, args.update_freq), env, epoch_itr.epoch)
    logger.info(f"begin training epoch {epoch_itr.epoch}")
    valid_losses: List[Optional[float]] = [None]
    should_stop = False
    with metrics.aggregate("train"):
        for samples in progress:
            with metrics.aggregate("train_inner"):
                log_output = trainer.train_step(samples)
            if log_output is not None and trainer.num_updates % args.log_interval == 0:
                progress.log(metrics.get_training_stats("train_inner"), tag="train_inner", step=trainer.num_updates)
                metrics.reset_meters("train_inner")
            end_of_epoch = not itr.has_next()
            valid_losses, should_stop = validate_and_save(
                args, trainer, task, epoch_itr, env, best, end_of_epoch, start_time)
            if should_stop:
                break
    logger.info(f"end of epoch {epoch_itr.epoch} (average epoch stats below)")
    progress.print(metrics.get_training_stats("train"), tag="train", step=trainer.num_updates)
    metrics.reset_meters("train")
    return valid_losses, should_stop


def stop_reason(args, trainer: Trainer, start_time: float) -> Optional[str]:
    if args.max_update > 0 and trainer.num_updates >= args.max_update:
        return f"num_updates: {trainer.num_updates} >= max_update: {args.max_update}"
    hours = (time.time() - start_time) / 3600
    if args.stop_time_hours > 0 and hours > args.stop_time_hours:
        return f"cumulative_training_time: {hours:.4f} > stop_time_hours: {args.stop_time_hours} hour(s)"
    if args.stop_min_lr >= 0 and trainer.get_lr() <= args.stop_min_lr:
        return f"lr: {trainer.get_lr()} <= stop_min_lr: {args.stop_min_lr}"
    return None


def validate_and_save(args, trainer: Trainer, task, epoch_itr, env: DistributedEnv, best: ckpt.BestTracker,
                      end_of_epoch: bool, start_time: float) -> Tuple[List[Optional[float]], bool]:
    updates = trainer.num_updates
    reason = stop_reason(args, trainer, start_time)
    should_stop = not all_ranks_agree(reason is None, env.device)  # any rank's clock can stop all
    if reason:
        logger.info(f"Stopping training due to {reason}")
    do_save = (end_of_epoch and epoch_itr.epoch % args.save_interval == 0) or should_stop or (
        args.save_interval_updates > 0 and updates > 0 and updates % args.save_interval_updates == 0)
    do_validate = not args.disable_validation and (
        (end_of_epoch and epoch_itr.epoch % args.validate_interval == 0) or should_stop or do_save or (
            args.validate_interval_updates > 0 and updates > 0 and updates % args.validate_interval_updates == 0))
    valid_losses: List[Optional[float]] = [None]
    if do_validate:
        valid_losses = validate(args, trainer, task, epoch_itr.epoch, env, best)
    if ckpt.out_of_patience(args, best, valid_losses[0]):
        logger.info(f"early stop since valid performance hasn't improved for last {args.patience} runs")
        should_stop = True
    if do_save and not args.no_save:
        ckpt.save_checkpoint(args, trainer, epoch_itr, valid_losses[0], best, end_of_epoch, env)
    best.update(valid_losses[0])
    return valid_losses, should_stop


def validate(args, trainer: Trainer, task, epoch: int, env: DistributedEnv,
             best: ckpt.BestTracker) -> List[Optional[float]]:
    losses: List[Optional[float]] = []
    for subset in args.valid_subset.split(","):
        logger.info(f'begin validation on "{subset}" subset')
        progress = make_progress(args, valid_iterator(args, task, subset, env).next_epoch_itr(shuffle=False),
                                 env, epoch, prefix=f"valid on '{subset}' subset")
        with metrics.aggregate(new_root=True) as agg:
            totals: dict = {"_batches": 0.0}
            for sample in progress:
                for k, v in trainer.valid_step(sample).items():
                    totals[k] = totals.get(k, 0.0) + v
                totals["_batches"] += 1
            totals = all_reduce_sums(totals, env.device, env.world_size)
            totals["sample_size"] = totals.pop("_sample_size", 0.0)
            batches = totals.pop("_batches") / env.world_size
            trainer.criterion.reduce_metrics([totals])
            metrics.log_valid_metrics(totals.get("ntokens", 0), totals.get("nsentences", 0), num_batches=batches)
        stats = metrics.get_valid_stats(agg.get_smoothed_values(), trainer.num_updates,
                                        best=best.best if best.best is not None else None,
                                        best_checkpoint_metric=args.best_checkpoint_metric,
                                        maximize=best.maximize)
        if best.best is None and args.best_checkpoint_metric in stats:
            stats[f"best_{args.best_checkpoint_metric}"] = stats[args.best_checkpoint_metric]
        progress.print(stats, tag=subset, step=trainer.num_updates)
        losses.append(stats.get(args.best_checkpoint_metric))
    return losses


def cli_main(argv: Optional[List[str]] = None) -> None:
    args = options.parse_with_components("toolkit-train", TRAIN_CONFIGS, argv,
                                         description="Train a language model.")
    try:
        launch.run(main, args)
    except (UserError, FloatingPointError) as e:
        print(f"toolkit-train: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    cli_main()
