"""The training loop: epochs of updates, validation, checkpoints, stopping (fairseq's ``train.py``).

``train(cfg)`` is what every rank of ``toolkit-train`` runs once the command line is
resolved (:mod:`toolkit.train.resolve`) and the processes are launched
(:mod:`toolkit.distributed.launch`)::

    env = init_distributed(...)                      # torchrun's / our launcher's process group
    trainer = build_trainer(cfg, env, splits)        # task, model (wrapped), criterion, optimizer
    position = load_latest(...)                      # resume where checkpoint_last.pt stopped
    while epochs remain:
        for each group of --update-freq batches:     # train_epoch
            trainer.train_step(batches); log; maybe validate and save; maybe stop
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from toolkit.train import checkpoint_manager as manager
from toolkit.checkpoint.common import BestTracker, TrainingState
from toolkit.config import TrainConfig
from toolkit.core.protocols import Bounded, FlopsCounted
from toolkit.data.batching import filter_by_size
from toolkit.data.iterators import GroupedIterator
from toolkit.distributed import heartbeat
from toolkit.distributed.parallel_dims import DP_AXES
from toolkit.distributed.parallelize import build_parallel_model, unwrapped
from toolkit.distributed.utils import DistributedEnv, all_ranks_agree, all_reduce_sums, init_distributed
from toolkit.core.errors import Interrupted, UserError
from toolkit.evaluation import during_training as harness_training
from toolkit.config.flag_types import for_epoch
from toolkit.logging import metrics, throughput
from toolkit.logging.progress_bar import build_progress_bar
from toolkit.logging.setup import setup_logging
from toolkit.logging.wandb_writer import finish as finish_wandb
from toolkit.logging.wandb_writer import wrap_with_wandb
from toolkit import ops
from toolkit.core.preflight import check_writable_folder
from toolkit.core.registry import CRITERION_REGISTRY, TASK_REGISTRY
from toolkit.train.trainer import Trainer

logger = logging.getLogger("toolkit_cli.train")  # fairseq's log lines name the command (fairseq_cli.train)


def empty_cache_due(common: Any, num_updates: int) -> bool:
    """``--empty-cache-freq``, fairseq's trainer: ``torch.cuda.empty_cache()`` when
    ``(num_updates + empty_cache_freq - 1) % freq == 0``."""
    freq = common.empty_cache_freq
    return freq > 0 and (num_updates + freq - 1) % freq == 0


def train(cfg: TrainConfig) -> None:
    """One rank's whole run."""
    env = init_distributed(cfg.distributed, cpu=cfg.common.cpu)
    setup_logging(cfg.common.log_file, rank=env.rank)
    check_outputs(cfg, env)
    logger.info(cfg.summary())
    torch.manual_seed(cfg.common.seed)
    choose_cpu_matmul(cfg.common.cpu_matmul, env)
    trainer = build_trainer(cfg, env, [cfg.dataset.train_subset, *cfg.dataset.valid_subset.split(",")])
    load_combined_valid(cfg, trainer.task)
    check_valid_splits(cfg, trainer)
    metrics.log_wall_start()
    spec = throughput_spec(cfg, trainer.model, env, trainer.compute_dtype)
    logger.info(f"training on {env.world_size} devices ({env.device.type})")
    for line in long_context_lines(cfg):
        logger.info(line)
    logger.info(
        f"max tokens per device = {cfg.dataset.max_tokens} and max sentences per device = {cfg.dataset.batch_size}"
    )
    state = TrainingState(trainer, BestTracker(cfg.checkpoint.maximize_best_checkpoint_metric))
    manager.prepare_save_dir(cfg, env)
    position = manager.load_latest(cfg, trainer, state, env)
    state.epoch_itr = train_iterator(cfg, trainer, epoch=position.get("epoch", 1) if position else 1)
    if position and not cfg.checkpoint.reset_dataloader:
        state.epoch_itr.load_state_dict(position)
        log_update_freq_change(position, cfg.optimization.update_freq)
    done = manager.finished_reason(cfg, trainer, state.epoch_itr) if position is not None else None
    if done:  # a finished run restarted: nothing is trained or written
        if env.is_master:
            print(done, flush=True)
        return
    if position is not None and os.path.basename(cfg.checkpoint.restore_file).startswith("checkpoint_last"):
        state.saved_update = trainer.num_updates
    start = time.time()
    reporting_interruptions(lambda: train_epochs(cfg, trainer, state, env, spec, start), cfg, state)
    logger.info(f"done training in {time.time() - start:.1f} seconds")
    if cfg.common.wandb_project and env.is_master:
        finish_wandb()


def long_context_lines(cfg: TrainConfig) -> List[str]:
    """What context parallelism and RoPE scaling do to this run, said once at start-up (both change what a position
    means, and nothing else in the log would show them)."""
    lines, T = [], cfg.task.tokens_per_sample if cfg.task is not None else None
    cp = cfg.distributed.context_parallel_size
    if cp > 1 and T:
        lines.append(
            f"context parallelism: each {T}-token sequence is cut into {2 * cp} chunks of {T // (2 * cp)}; a rank "
            f"holds 2 of them (load-balanced under the causal mask) and attends over keys/values gathered from "
            f"the {cp} ranks of its cp group"
        )
    factor = getattr(cfg.model, "rope_scaling_factor", None)
    if factor:
        kind, original = cfg.model.rope_scaling, cfg.model.rope_original_max_positions
        line = f"RoPE scaling: {kind}, factor {factor:g}: a context of {original} positions stretched to {original * factor:g}"
        if kind == "yarn":
            attention = cfg.model.rope_attention_factor or 0.1 * math.log(factor) + 1.0
            line += f" (attention factor {attention:.4g}, beta_fast {cfg.model.rope_yarn_beta_fast:g}, beta_slow {cfg.model.rope_yarn_beta_slow:g})"
        lines.append(f"{line}; --tokens-per-sample {T}")
    return lines


def log_update_freq_change(position: dict, update_freq: int) -> None:
    """--update-freq only groups the batches: the run resumes at the same sample, with other updates."""
    saved = position.get("update_freq")
    if saved is not None and saved != update_freq and position.get("samples_in_epoch"):
        logger.info(
            f"--update-freq {saved} -> {update_freq}: resuming at sample {position['samples_in_epoch']} "
            f"of epoch {position.get('epoch')}, {update_freq} batches per update from here"
        )


def train_epochs(
    cfg: TrainConfig, trainer: Trainer, state: TrainingState, env: DistributedEnv, spec, start: float
) -> None:
    """Epoch after epoch until a stopping rule says so (--max-epoch, --max-update, --stop-time-hours, ...)."""
    while state.epoch_itr.next_epoch_idx <= (cfg.optimization.max_epoch or math.inf):
        valid_losses, should_stop = train_epoch(cfg, trainer, state, env, spec, start)
        if should_stop:
            break
        trainer.lr_step(state.epoch_itr.epoch, valid_losses[0])
        state.epoch_itr = train_iterator(cfg, trainer, epoch=state.epoch_itr.next_epoch_idx)


def reporting_interruptions(run: Callable[[], None], cfg: TrainConfig, state: TrainingState) -> None:
    """``run()``, with Ctrl-C and a killed data loader worker turned into one line (``interruption_report``).

    Two levels of ``except`` in one frame: torch's SIGCHLD handler may raise its error while the first sign of
    the worker's death is being reported, and the outer level takes that late error."""
    try:
        try:
            run()
        except BaseException as error:
            report = interruption_report(error, cfg, state)
            if report is None:
                raise
            raise report from None
    except RuntimeError as error:
        report = interruption_report(error, cfg, state)
        if report is None:
            raise
        raise report from None


def interruption_report(error: BaseException, cfg: TrainConfig, state: TrainingState) -> Optional[Exception]:
    """Ctrl-C and a killed data loader worker as one line saying where the run stopped and what is saved
    (``Interrupted`` / ``UserError``); None for any other error, which propagates as it is.

    torch reports a worker's death from its SIGCHLD handler, which raises ``RuntimeError`` in whatever Python
    code runs at that instant: when the main process was reading that worker's batch, the read fails first
    (``ConnectionResetError``) and the handler's error may land while that first one is being reported, even
    in the first line of an ``except`` or a context manager's ``__exit__`` (seen in CI). ``reporting_interruptions``
    therefore catches twice in one frame, and this function's first act on a worker's death silences the
    handler, so nothing raises a third time."""
    if isinstance(error, KeyboardInterrupt):
        return Interrupted(f"interrupted at update {state.trainer.num_updates}; {_last_saved(cfg, state)}")
    if not isinstance(error, (RuntimeError, ConnectionError, EOFError)):
        return None
    if not _data_loader_worker_died(error, cfg.dataset.num_workers):
        return None
    _quiet_worker_teardown()
    what = str(error).splitlines()[0].rstrip(". ") if isinstance(error, RuntimeError) else "its connection broke"
    return UserError(
        f"--num-workers {cfg.dataset.num_workers}: a data loader worker died at update "
        f"{state.trainer.num_updates} ({what}); {_last_saved(cfg, state)}: run again to resume"
    )


def _data_loader_worker_died(error: BaseException, num_workers: int) -> bool:
    """torch's SIGCHLD handler says so (``RuntimeError: DataLoader worker ... is killed``), or, when the main
    process was reading a batch's shared memory from the worker at that instant, the read fails first
    (``ConnectionResetError`` in ``rebuild_storage_fd``, ``EOFError``) and the handler fires a moment later."""
    if isinstance(error, RuntimeError):
        return "DataLoader worker" in str(error)
    return num_workers > 0


def _quiet_worker_teardown() -> None:
    """After a data loader worker was killed, multiprocessing's descriptor-sharing thread may still report
    the broken connection as a traceback (``resource_sharer._serve`` calls ``sys.excepthook``) while the
    process exits, and torch's SIGCHLD handler would raise again inside the error line's own ``print``; the
    one line about the worker has said what happened, so the rest stays quiet."""
    sys.excepthook = lambda *exc_info: None
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    except ValueError:  # not the main thread: torch installed no handler there either
        pass


def _last_saved(cfg: TrainConfig, state: TrainingState) -> str:
    name = "checkpoint_last" if cfg.checkpoint.use_sharded_state else "checkpoint_last.pt"
    if state.saved_update is None:
        return f"no {name} saved yet"
    return f"{name} is update {state.saved_update}"


def check_outputs(cfg: TrainConfig, env: DistributedEnv) -> None:
    """--save-dir and --tensorboard-logdir take files, found before the first update, not at the first save."""
    if not cfg.checkpoint.no_save:
        check_writable_folder("--save-dir", cfg.checkpoint.save_dir)
    if cfg.common.tensorboard_logdir and env.is_master:
        check_writable_folder("--tensorboard-logdir", cfg.common.tensorboard_logdir)


def build_trainer(cfg: TrainConfig, env: DistributedEnv, splits: Sequence[str] = ()) -> Trainer:
    """The task (with ``splits`` loaded), the model wrapped as the flags ask, its criterion and the Trainer."""
    task = TASK_REGISTRY.get(cfg.components.task).cls.setup_task(cfg.task)
    for split in splits:
        task.load_dataset(split)
    model, strategy = build_parallel_model(cfg, task, env)
    criterion = CRITERION_REGISTRY.get(cfg.components.criterion).cls(task, cfg.criterion)
    return Trainer(cfg, task, model, criterion, env, strategy)


def load_combined_valid(cfg: TrainConfig, task) -> None:
    """fairseq's --combine-val: the "valid" split is valid, valid1, valid2, ... concatenated."""
    if cfg.dataset.combine_valid_subsets and not cfg.dataset.disable_validation:
        task.load_dataset("valid", combine=True)


def throughput_spec(
    cfg: TrainConfig, model: torch.nn.Module, env: DistributedEnv, dtype: torch.dtype
) -> throughput.ThroughputSpec:
    """tokens/s per device and MFU against one device's peak (on CPU: measured once per machine)."""
    inner = unwrapped(model)
    flops = inner.flops_per_token(cfg.task.tokens_per_sample) if isinstance(inner, FlopsCounted) else 0.0
    if env.device.type == "cpu":
        # A CPU without native fp16/bf16 matmuls converts to fp32: its best rate is the ceiling either way
        # (the reduced dtype's measured rate alone once gave an MFU of 134% under --memory-efficient-fp16).
        peaks = {d: shared_cpu_peak(env, d) for d in dict.fromkeys((dtype, torch.float32))}
        best = max(peaks, key=lambda d: peaks[d][0])
        peak, machine, source = peaks[best]
        share = (
            f"; this machine's {machine / 1e9:.1f} shared by {env.local_world_size} processes"
            if machine != peak
            else ""
        )
        logger.info(f"MFU peak: {peak / 1e9:.1f} GFLOP/s a process ({source}{share})")
    else:
        peak = throughput.peak_flops(env.device, dtype)
        logger.info(f"MFU peak: {peak / 1e12:.1f} TFLOP/s ({dtype}, {torch.cuda.get_device_name(env.device)})")
    return throughput.ThroughputSpec(flops, peak, env.world_size)


def choose_cpu_matmul(choice: str, env: DistributedEnv) -> None:
    """``--cpu-matmul`` on a CPU run, alike on every rank: global rank 0 decides (``auto`` measures once per
    machine, ``toolkit.ops.select``) while the others wait, and its decision is everyone's."""
    if env.device.type != "cpu":
        return
    if not (dist.is_initialized() and env.world_size > 1):
        ops.select(choice)
        return
    decision = torch.tensor([float(ops.select(choice)) if env.rank == 0 else 0.0])
    dist.broadcast(decision, src=0)
    if env.rank != 0:
        ops.select("onednn" if decision.item() else "torch")


def shared_cpu_peak(env: DistributedEnv, dtype: torch.dtype) -> Tuple[float, float, str]:
    """This process's share of the machine's CPU peak, the machine's, and where it came from (on local rank 0,
    which measures it while the others wait).

    Measured with the threads of all local processes together, then split between them
    (nodes are assumed alike: the largest node measurement is used everywhere).
    """
    machine, source = 0.0, ""
    if dist.is_initialized() and env.world_size > 1:
        dist.barrier()  # nobody computes while the peak is measured
    if env.local_rank == 0:
        threads = min(torch.get_num_threads() * max(1, env.local_world_size), max(1, _cpu_count()))
        machine = throughput.measure_cpu_peak_flops(dtype, threads=threads)
        source = throughput.cpu_peak_source(dtype, threads)
    if dist.is_initialized() and env.world_size > 1:
        t = torch.tensor([machine], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        machine = float(t.item())
    return throughput.per_process_cpu_peak(machine, env.local_world_size), machine, source


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def train_iterator(cfg: TrainConfig, trainer: Trainer, epoch: int):
    """This replica's batches of the epoch: sharded over the data-parallel replicas (the M ranks of a
    tensor-parallel replica read the same ones); samples too long are skipped (``train_max_positions``)."""
    data, dims = cfg.dataset, trainer.strategy.dims
    itr = trainer.task.get_batch_iterator(
        trainer.task.dataset_for_epoch(data.train_subset, epoch),
        max_tokens=data.max_tokens,
        batch_size=data.batch_size,
        required_batch_size_multiple=data.required_batch_size_multiple,
        seed=cfg.common.seed,
        num_shards=dims.data_world,
        shard_id=dims.data_rank,
        num_workers=data.num_workers,
        epoch=epoch,
        max_positions=train_max_positions(cfg, trainer),
        ignore_invalid_inputs=True,
    )
    if len(itr) == 0:  # an epoch without a batch would end at once, forever (114,672 empty epochs in 2 minutes)
        raise UserError(
            f"{cfg.task.data}: the --train-subset {data.train_subset} split gives no batch in epoch "
            f"{epoch} (it has no samples); binarize text into it (toolkit-preprocess --trainpref)"
        )
    return itr


def train_max_positions(cfg: TrainConfig, trainer: Trainer) -> Optional[int]:
    """As fairseq's training: a sample longer than the model takes is skipped (one warning with the
    count), so sentence-level training (--sample-break-mode eos|complete) does not stop on a long line."""
    return valid_max_positions(trainer)


def check_valid_splits(cfg: TrainConfig, trainer: Trainer) -> None:
    """Before the first update, what validation would refuse: an empty --valid-subset split, a sample longer
    than the model takes (unless skipped), a split whose every sample is skipped; refused now, not after an
    epoch whose updates are then lost."""
    if cfg.dataset.disable_validation:
        return
    limit, skip = valid_max_positions(trainer), cfg.dataset.skip_invalid_size_inputs_valid_test
    for subset in cfg.dataset.valid_subset.split(","):
        dataset = trainer.task.dataset(subset)
        refuse_empty_split(subset, dataset)
        lengths = getattr(dataset, "seq_lengths", None)  # what the batching filters by
        if limit is None or lengths is None:
            continue
        _, dropped = filter_by_size(np.arange(len(dataset)), lengths(), limit)
        if len(dropped) and (not skip or len(dropped) == len(dataset)):
            first = int(dropped[0])
            raise UserError(
                f"--valid-subset {subset}: {len(dropped)} of its {len(dataset)} samples are longer than the model's "
                f"{limit} positions (e.g. sample {first}: {int(lengths()[first])} tokens)"
                + (
                    "; every one would be skipped: raise --tokens-per-sample or pass --shorten-method truncate"
                    if skip
                    else "; skip them with --skip-invalid-size-inputs-valid-test (as fairseq), raise "
                    "--tokens-per-sample, or use a break mode that bounds the sample size"
                )
            )


def refuse_empty_split(subset: str, dataset) -> None:
    """A split without a sample validates to loss 0 and perplexity 1, which would be saved as the best."""
    if len(dataset) == 0:
        raise UserError(
            f"--valid-subset {subset}: the split has no samples, so its loss would read 0 (perplexity "
            f"1); binarize text into it (toolkit-preprocess --validpref) or leave it out of "
            f"--valid-subset"
        )


def valid_iterator(cfg: TrainConfig, trainer: Trainer, subset: str):
    """As fairseq: samples longer than the model takes are an error, or skipped under
    --skip-invalid-size-inputs-valid-test; an empty split is an error."""
    data, dims = cfg.dataset, trainer.strategy.dims
    refuse_empty_split(subset, trainer.task.dataset(subset))
    return trainer.task.get_batch_iterator(
        trainer.task.dataset(subset),
        max_tokens=data.max_tokens_valid or data.max_tokens,
        batch_size=data.batch_size_valid or data.batch_size,
        required_batch_size_multiple=data.required_batch_size_multiple,
        seed=cfg.common.seed,
        num_shards=dims.data_world,
        shard_id=dims.data_rank,
        num_workers=data.num_workers,
        epoch=1,
        max_positions=valid_max_positions(trainer),
        ignore_invalid_inputs=data.skip_invalid_size_inputs_valid_test,
    )


def valid_max_positions(trainer: Trainer) -> Optional[int]:
    """The smaller of what the task produces and what the model takes (fairseq's resolve_max_positions)."""
    limits = [part.max_positions() for part in (trainer.task, unwrapped(trainer.model)) if isinstance(part, Bounded)]
    known = [int(x) for x in limits if isinstance(x, (int, float))]
    return min(known) if known else None


def make_progress(cfg: TrainConfig, iterator, env: DistributedEnv, epoch: int, prefix: Optional[str] = None):
    """fairseq's progress bar and log lines, TensorBoard and (``--wandb-project``) W&B on the master rank."""
    bar = build_progress_bar(cfg.common, iterator, epoch, prefix=prefix, is_master=env.is_master)
    project = cfg.common.wandb_project if env.is_master else None
    return wrap_with_wandb(bar, project, os.path.basename(os.path.normpath(cfg.checkpoint.save_dir)))


def train_epoch(
    cfg: TrainConfig,
    trainer: Trainer,
    state: TrainingState,
    env: DistributedEnv,
    spec: throughput.ThroughputSpec,
    start_time: float,
) -> Tuple[List[Optional[float]], bool]:
    """One ``train_step`` per group of ``--update-freq`` batches; log, validate, save."""
    epoch_itr = state.epoch_itr
    itr = epoch_itr.next_epoch_itr(shuffle=True)
    trainer.lr_scheduler.step_begin_epoch(epoch_itr.epoch)
    update_freq = for_epoch(cfg.optimization.update_freq_per_epoch or (cfg.optimization.update_freq,), epoch_itr.epoch)
    progress = make_progress(cfg, GroupedIterator(itr, update_freq), env, epoch_itr.epoch)
    logger.info(f"begin training epoch {epoch_itr.epoch}")
    valid_losses: List[Optional[float]] = [None]
    should_stop = False
    with metrics.aggregate("train"):
        for samples in progress:
            heartbeat.progress()  # tells the other ranks' watchdogs this one is alive
            with metrics.aggregate("train_inner"):
                log_output = trainer.train_step(samples)
                if env.device.type == "cuda" and empty_cache_due(cfg.common, trainer.num_updates):
                    torch.cuda.empty_cache()  # --empty-cache-freq
                if log_output is not None:
                    metrics.log_throughput(log_output.get("ntokens"), spec)
            if log_output is not None and trainer.num_updates % cfg.common.log_interval == 0:
                progress.log(metrics.get_training_stats("train_inner"), tag="train_inner", step=trainer.num_updates)
                metrics.reset_meters("train_inner")
            valid_losses, should_stop = validate_and_save(cfg, trainer, state, env, not itr.has_next(), start_time)
            if should_stop:
                break
    logger.info(f"end of epoch {epoch_itr.epoch} (average epoch stats below)")
    progress.print(metrics.get_training_stats("train"), tag="train", step=trainer.num_updates)
    metrics.reset_meters("train")
    return valid_losses, should_stop


def stop_reason(cfg: TrainConfig, trainer: Trainer, start_time: float) -> Optional[str]:
    opt = cfg.optimization
    if opt.max_update > 0 and trainer.num_updates >= opt.max_update:
        return f"num_updates: {trainer.num_updates} >= max_update: {opt.max_update}"
    hours = (time.time() - start_time) / 3600
    if opt.stop_time_hours > 0 and hours > opt.stop_time_hours:
        return f"cumulative_training_time: {hours:.4f} > stop_time_hours: {opt.stop_time_hours} hour(s)"
    if opt.stop_min_lr >= 0 and trainer.get_lr() <= opt.stop_min_lr:
        return f"lr: {trainer.get_lr()} <= stop_min_lr: {opt.stop_min_lr}"
    return None


def _every(interval: int, updates: int) -> bool:
    return interval > 0 and updates > 0 and updates % interval == 0


def validate_and_save(
    cfg: TrainConfig, trainer: Trainer, state: TrainingState, env: DistributedEnv, end_of_epoch: bool, start_time: float
) -> Tuple[List[Optional[float]], bool]:
    updates, epoch, ckpt = trainer.num_updates, state.epoch_itr.epoch, cfg.checkpoint
    reason = stop_reason(cfg, trainer, start_time)
    should_stop = not all_ranks_agree(reason is None, env.device)  # any rank's clock can stop all
    if reason:
        logger.info(f"Stopping training due to {reason}")
    after = updates >= cfg.dataset.validate_after_updates  # fairseq: no validation (nor mid-epoch save) before
    do_save = (
        (end_of_epoch and epoch % ckpt.save_interval == 0)
        or should_stop
        or (_every(ckpt.save_interval_updates, updates) and after)
    )
    # fairseq validates at every mid-epoch save (checkpoint_best needs a loss); given --validate-interval-updates,
    # that interval alone decides, and a save between two validations keeps the best of the last one
    saves_validate = do_save and not end_of_epoch and cfg.dataset.validate_interval_updates == 0
    do_validate = (
        not cfg.dataset.disable_validation
        and after
        and (
            (end_of_epoch and epoch % cfg.dataset.validate_interval == 0)
            or should_stop
            or saves_validate
            or _every(cfg.dataset.validate_interval_updates, updates)
        )
    )
    valid_losses: List[Optional[float]] = validate(cfg, trainer, epoch, env, state.best) if do_validate else [None]
    if after and harness_training.due(cfg.dataset, updates):
        valid_losses = eval_harness(cfg, trainer, env, epoch, valid_losses)
    if state.best.out_of_patience(ckpt.patience, valid_losses[0]):
        logger.info(f"early stop since valid performance hasn't improved for last {ckpt.patience} runs")
        should_stop = True
    state.val_loss = valid_losses[0]
    if do_save and not ckpt.no_save:
        manager.save_checkpoint(cfg, trainer, state, end_of_epoch, env)
        if not ckpt.no_last_checkpoints:
            state.saved_update = updates
    state.best.update(valid_losses[0])
    return valid_losses, should_stop


def validate(
    cfg: TrainConfig, trainer: Trainer, epoch: int, env: DistributedEnv, best: BestTracker
) -> List[Optional[float]]:
    losses: List[Optional[float]] = []
    metric = cfg.checkpoint.best_checkpoint_metric
    if cfg.dataset.fixed_validation_seed is not None:
        seed_everything(cfg.dataset.fixed_validation_seed)  # fairseq: the same draws at every validation
    per_subset: Dict[str, Dict[str, Any]] = {}
    for subset in cfg.dataset.valid_subset.split(","):
        logger.info(f'begin validation on "{subset}" subset')
        progress = make_progress(
            cfg,
            valid_iterator(cfg, trainer, subset).next_epoch_itr(shuffle=False),
            env,
            epoch,
            prefix=f"valid on '{subset}' subset",
        )
        with metrics.aggregate(new_root=True) as agg:
            valid_totals(trainer, progress)
        stats = _valid_stats(cfg, agg.get_smoothed_values(), trainer.num_updates, best)
        progress.print(stats, tag=subset, step=trainer.num_updates)
        per_subset[subset] = stats
        losses.append(stats.get(metric))
    mixture = getattr(trainer.task, "mixture", None)
    if mixture:  # the weighted totals first: they are what --best-checkpoint-metric follows
        totals = weighted_valid_totals(mixture, per_subset, metric)
        for tag, values in reversed(list(totals.items())):
            stats = _valid_stats(cfg, values, trainer.num_updates, best)
            total_bar = make_progress(cfg, [], env, epoch, prefix=f"valid on '{tag}' subset")
            total_bar.print(stats, tag=tag, step=trainer.num_updates)
            losses.insert(0, stats.get(metric))
    return losses


def eval_harness(
    cfg: TrainConfig, trainer: Trainer, env: DistributedEnv, epoch: int, valid_losses: List[Optional[float]]
) -> List[Optional[float]]:
    """--eval-harness-tasks: log the metrics (master rank evaluates, all ranks get them); one named
    by --best-checkpoint-metric takes the place of validation's value."""
    stats = harness_training.evaluator(cfg).evaluate(trainer, env)
    metric = cfg.checkpoint.best_checkpoint_metric
    make_progress(cfg, [], env, epoch).print(
        {**stats, "num_updates": trainer.num_updates}, tag="eval_harness", step=trainer.num_updates
    )
    return [stats[metric], *valid_losses[1:]] if metric in stats else valid_losses


def _valid_stats(cfg: TrainConfig, values: Dict[str, Any], num_updates: int, best: BestTracker) -> Dict[str, Any]:
    metric = cfg.checkpoint.best_checkpoint_metric
    stats = metrics.get_valid_stats(
        values, num_updates, best=best.best, best_checkpoint_metric=metric, maximize=best.maximize
    )
    if best.best is None and metric in stats:
        stats[f"best_{metric}"] = stats[metric]
    return stats


def weighted_valid_totals(mixture, per_subset: Dict[str, Dict[str, Any]], metric: str) -> Dict[str, Dict[str, Any]]:
    """``{"valid": {"loss", "ppl"}}``: the sources' valid_NAME losses weighted by the mixture's weights
    (renormalized over the sources that have that split)."""
    totals: Dict[str, Dict[str, Any]] = {}
    for subset in per_subset:
        for source in mixture:
            if subset.endswith("_" + source.name):
                base = subset[: -len(source.name) - 1]
                entry = totals.setdefault(base, {"loss": 0.0, "weight": 0.0, metric: 0.0})
                entry["loss"] += source.weight * float(per_subset[subset]["loss"])
                if metric != "loss":
                    entry[metric] += source.weight * float(per_subset[subset].get(metric, 0.0))
                entry["weight"] += source.weight
    out = {}
    for base, entry in totals.items():
        loss = entry["loss"] / entry["weight"]
        values = {"loss": round(loss, 3), "ppl": round(2**loss, 2)}
        if metric not in values:
            values[metric] = entry[metric] / entry["weight"]
        out[base] = values
    return out


def seed_everything(seed: int) -> None:
    """torch's generators (CPU and every GPU); training reseeds per update (Trainer._set_seed)."""
    torch.manual_seed(seed)


def valid_totals(trainer: Trainer, progress) -> Dict[str, float]:
    """Sum every replica's validation outputs and log them once (fairseq's numbers); returns the sums (the loss
    in nats, ``ntokens``, ``sample_size``, ...)."""
    totals: dict = {"_batches": 0.0}
    for sample in progress:
        for k, v in trainer.valid_step(sample).items():
            totals[k] = totals.get(k, 0.0) + v
        totals["_batches"] += 1
    dims = trainer.strategy.dims
    totals = all_reduce_sums(totals, trainer.device, dims.loss_world, group=dims.group(*DP_AXES))
    totals["sample_size"] = totals.pop("_sample_size", 0.0)
    batches = totals.pop("_batches") / dims.loss_world
    trainer.criterion.reduce_metrics([totals])
    metrics.log_valid_metrics(totals.get("ntokens", 0), totals.get("nsentences", 0), num_batches=batches)
    return totals
