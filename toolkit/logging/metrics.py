"""Metrics aggregation, fairseq-compatible (same API, priorities, rounding and output order).

Values are logged from anywhere with the ``log_*`` functions; they go to every
*active* aggregator. The ``"default"`` aggregator is always active; more are
activated with the :func:`aggregate` context manager (also usable as a decorator)::

    with metrics.aggregate("train"):              # whole epoch
        for samples in progress:
            with metrics.aggregate("train_inner"):  # reset after every log line
                trainer.train_step(samples)
            ...

Priorities decide the order of the keys in a log line (smaller first; ties keep
the order of first logging). The standard fairseq keys and their priorities /
rounding (see :data:`PRIORITY` and the ``log_*_metrics`` helpers below):

=============  ========  =====  ===================================================
key            priority  round  logged by
=============  ========  =====  ===================================================
loss           10        3      criterion: sum_loss / sample_size / ln 2 (base 2)
nll_loss       10        3      criterion, only when sample_size != ntokens
ppl            20        2      criterion, derived: 2 ** (nll_)loss
wps            90        1      task: ntokens per second (speed meter)
ups            100       2      trainer: updates per second (speed meter)
wpb            180       1      task: ntokens per update
bsz            190       1      task: nsentences per update
num_updates    200       -      trainer (weight 0: latest value)
lr             300       -      trainer (weight 0)
gnorm          400       3      trainer
clip           500       1      trainer, only with --clip-norm > 0 (% of clipped updates)
loss_scale     700       4      trainer, fp16 only (weight 0)
wall           790       0      trainer init, "default" aggregator; added last by get_training_stats
train_wall     800       0      trainer: log_start_time / log_stop_time around each update
gb_free        1500      1      trainer, CUDA only (weight 0)
tps            2000      1      ours: tokens/s per device (speed meter), after ``wall``
mfu            2010      2      ours, derived: model FLOPs utilisation in percent
=============  ========  =====  ===================================================

The loop that produces fairseq's ``train_inner`` / ``valid`` / ``train`` lines::

    setup_logging(cfg.log_file, rank)                       # once, at start
    metrics.log_wall_start()                                # once, trainer built (outside aggregate)
    spec = ThroughputSpec(model.flops_per_token(T), peak_flops(device, dtype), world_size)
    # after loading a checkpoint (unless --reset-meters): metrics.load_state_dict(state["metrics"])

    with metrics.aggregate("train"):                        # one epoch
        progress = progress_bar.build_progress_bar(cfg.common, itr, epoch=epoch, is_master=rank == 0)
        for samples in progress:
            with metrics.aggregate("train_inner"):
                out = trainer.train_step(samples)           # logs: train_wall start/stop, criterion
                                                            #   log_loss_metrics, log_standard_update_metrics
                metrics.log_throughput(out["ntokens"], spec)  # tps, mfu
            n = trainer.num_updates
            if n % cfg.log_interval == 0:
                progress.log(metrics.get_training_stats("train_inner"), tag="train_inner", step=n)
                metrics.reset_meters("train_inner")
    # validation (any time): a new root, so the train meters are untouched
    with metrics.aggregate(new_root=True) as agg:
        for sample in valid_progress:                       # prefix=f"valid on '{subset}' subset"
            out = trainer.valid_step(sample)                # then per batch (wps needs >= 2 batches):
            metrics.log_loss_metrics(out["loss"], out["_sample_size"], out["ntokens"])
            metrics.log_batch_metrics(out["ntokens"], out["nsentences"])
    stats = metrics.get_valid_stats(agg.get_smoothed_values(), trainer.num_updates, best=best_so_far)
    valid_progress.print(stats, tag=subset, step=trainer.num_updates)
    # end of epoch
    progress.print(metrics.get_training_stats("train"), tag="train", step=trainer.num_updates)
    metrics.reset_meters("train")
    # checkpoint: extra_state["metrics"] = metrics.state_dict()
"""

from __future__ import annotations

import contextlib
import math
import uuid
from collections import OrderedDict, defaultdict
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional

import torch

import toolkit.logging.meters as _meters
from .meters import (
    AverageMeter,
    Meter,
    MetersDict,
    StopwatchMeter,
    SumMeter,
    TimeMeter,  # noqa: F401
    safe_round,
    to_python,
)

if TYPE_CHECKING:
    from .throughput import ThroughputSpec

# fairseq's priorities, plus ours (>= AFTER_WALL_PRIORITY, printed after "wall").
PRIORITY = {
    "loss": 10,
    "nll_loss": 10,
    "ppl": 20,
    "wps": 90,
    "ups": 100,
    "wpb": 180,
    "bsz": 190,
    "num_updates": 200,
    "lr": 300,
    "gnorm": 400,
    "clip": 500,
    "loss_scale": 700,
    "wall": 790,
    "train_wall": 800,
    "gb_free": 1500,
    "tps": 2000,
    "mfu": 2010,
}
# Keys logged with at least this priority come after "wall" in get_training_stats().
AFTER_WALL_PRIORITY = 2000

_aggregators: OrderedDict[str, MetersDict] = OrderedDict()
_active_aggregators: OrderedDict[str, MetersDict] = OrderedDict()
_active_aggregators_cnt: Dict[str, int] = defaultdict(lambda: 0)
_entry_times: List[float] = []  # when each enclosing aggregate() block was entered, innermost last


def _now() -> float:
    return _meters.time.perf_counter()  # the meters' clock


def reset() -> None:
    """Forget all aggregators: "default" is recreated, active, with only a fresh ``wall`` clock."""
    _aggregators.clear()
    _active_aggregators.clear()
    _active_aggregators_cnt.clear()
    _entry_times.clear()
    _aggregators["default"] = MetersDict()
    _active_aggregators["default"] = _aggregators["default"]
    _active_aggregators_cnt["default"] = 1
    log_wall_start()


@contextlib.contextmanager
def aggregate(name: Optional[str] = None, new_root: bool = False) -> Iterator[MetersDict]:
    """Aggregate the values logged inside the block under ``name`` (nested blocks all see them).

    With ``new_root=True`` the block starts a new stack: values logged inside it do not
    reach the enclosing aggregators (not even "default"); validation uses this so that
    it does not disturb the training meters. The same ``name`` reuses the same
    :class:`MetersDict`; ``name=None`` makes a temporary one.
    """
    if name is None:
        name = str(uuid.uuid4())
        assert name not in _aggregators
        agg = MetersDict()
    else:
        assert name != "default"
        agg = _aggregators.setdefault(name, MetersDict())

    if new_root:
        backup = _active_aggregators.copy()
        backup_cnt = _active_aggregators_cnt.copy()
        _active_aggregators.clear()
        _active_aggregators_cnt.clear()

    _active_aggregators[name] = agg
    _active_aggregators_cnt[name] += 1
    _entry_times.append(_now())
    try:
        yield agg
    finally:
        _entry_times.pop()
        _active_aggregators_cnt[name] -= 1
        if _active_aggregators_cnt[name] == 0 and name in _active_aggregators:
            del _active_aggregators[name]
        if new_root:
            _active_aggregators.clear()
            _active_aggregators.update(backup)
            _active_aggregators_cnt.clear()
            _active_aggregators_cnt.update(backup_cnt)


def get_active_aggregators() -> List[MetersDict]:
    return list(_active_aggregators.values())


# --- logging values -------------------------------------------------------------------


def log_scalar(key: str, value: Any, weight: float = 1, priority: int = 10, round: Optional[int] = None) -> None:
    """Log a value averaged with ``weight`` (weight 0: the latest value is reported)."""
    for agg in get_active_aggregators():
        if key not in agg:
            agg.add_meter(key, AverageMeter(round=round), priority)
        agg[key].update(value, weight)


def log_scalar_sum(key: str, value: Any, priority: int = 10, round: Optional[int] = None) -> None:
    """Log a value that is summed for reporting."""
    for agg in get_active_aggregators():
        if key not in agg:
            agg.add_meter(key, SumMeter(round=round), priority)
        agg[key].update(value)


def log_derived(key: str, fn: Callable[[MetersDict], Any], priority: int = 20) -> None:
    """Log a value computed at report time from the other meters: ``fn(meters)``.

    Derived meters are not saved by :func:`state_dict`; log them again every update.
    """
    for agg in get_active_aggregators():
        if key not in agg:
            agg.add_meter(key, MetersDict._DerivedMeter(fn), priority)


def log_speed(key: str, value: Any, priority: int = 30, round: Optional[int] = None) -> None:
    """Log the rate of some quantity per second (the first call only starts the clock)."""
    for agg in get_active_aggregators():
        if key not in agg:
            agg.add_meter(key, TimeMeter(round=round), priority)
            agg[key].reset()
        else:
            agg[key].update(value)


def log_start_time(key: str, priority: int = 40, round: Optional[int] = None) -> None:
    """Start a stopwatch; :func:`log_stop_time` adds the elapsed seconds."""
    for agg in get_active_aggregators():
        if key not in agg:
            agg.add_meter(key, StopwatchMeter(round=round), priority)
        agg[key].start()


def log_stop_time(key: str, weight: float = 0.0, prehook: Optional[Callable[[], None]] = None) -> None:
    """Stop the stopwatch ``key``; weight 0 reports the total time, weight > 0 the average.

    ``prehook`` (e.g. ``torch.cuda.synchronize``) runs before the clock is read.
    """
    for agg in get_active_aggregators():
        if key in agg:
            agg[key].stop(weight, prehook)


def log_custom(new_meter_fn: Callable[[], Meter], key: str, *args, priority: int = 50, **kwargs) -> None:
    """Log with a custom meter; extra arguments go to its ``update``."""
    for agg in get_active_aggregators():
        if key not in agg:
            agg.add_meter(key, new_meter_fn(), priority)
        agg[key].update(*args, **kwargs)


# --- reading / resetting --------------------------------------------------------------


def reset_meter(name: str, key: str) -> None:
    meter = get_meter(name, key)
    if meter is not None:
        meter.reset()


def reset_meters(name: str) -> None:
    """Reset the meters of aggregator ``name`` (e.g. "train_inner" after each log line)."""
    meters = get_meters(name)
    if meters is not None:
        meters.reset()


def get_meter(name: str, key: str) -> Optional[Meter]:
    if name not in _aggregators:
        return None
    return _aggregators[name].get(key, None)


def get_meters(name: str) -> Optional[MetersDict]:
    return _aggregators.get(name, None)


def get_smoothed_value(name: str, key: str) -> Any:
    return _aggregators[name].get_smoothed_value(key)


def get_smoothed_values(name: str) -> Dict[str, Any]:
    """Ordered {key: value} of aggregator ``name`` (KeyError if nothing was logged there)."""
    return _aggregators[name].get_smoothed_values()


def state_dict() -> Dict[str, Any]:
    """Plain-value state of every named aggregator (loadable with ``weights_only=True``)."""
    return {name: agg.state_dict() for name, agg in _aggregators.items()}


def load_state_dict(state_dict: Dict[str, Any]) -> None:
    """Restore meters saved by :func:`state_dict`; active aggregators are refilled in place."""
    for name, agg_state in state_dict.items():
        agg = _aggregators.setdefault(name, MetersDict())
        agg.load_state_dict(agg_state)


# --- fairseq's standard metrics ---------------------------------------------------------


def get_perplexity(loss: Any, round: int = 2, base: float = 2) -> float:
    """``base ** loss`` rounded as fairseq's ``utils.get_perplexity`` (inf on overflow)."""
    if loss is None:
        return 0.0
    try:
        return safe_round(base ** to_python(loss), round)
    except OverflowError:
        return float("inf")


def log_loss_metrics(loss_sum: Any, sample_size: Any, ntokens: Any, prefix: str = "") -> None:
    """Criterion side (fairseq's cross_entropy ``reduce_metrics``); call once per update/batch.

    ``loss_sum`` is the summed loss in nats (over all ranks / micro-batches). Logs
    ``loss`` = loss_sum / sample_size / ln 2 (weight sample_size, round 3); when
    sample_size != ntokens (``--sentence-avg``) also ``nll_loss`` per token; and the
    derived ``ppl`` = 2 ** loss (or 2 ** nll_loss), round 2.
    """
    loss_sum, sample_size, ntokens = to_python(loss_sum), to_python(sample_size), to_python(ntokens)
    loss_key, nll_key, ppl_key = prefix + "loss", prefix + "nll_loss", prefix + "ppl"
    if sample_size > 0:
        log_scalar(loss_key, loss_sum / sample_size / math.log(2), sample_size, round=3)
    else:
        log_scalar(loss_key, 0.0, 0, round=3)
    if sample_size != ntokens:
        if ntokens > 0:
            log_scalar(nll_key, loss_sum / ntokens / math.log(2), ntokens, round=3)
        else:
            log_scalar(nll_key, 0.0, 0, round=3)
        log_derived(ppl_key, lambda meters: get_perplexity(meters[nll_key].avg))
    else:
        log_derived(ppl_key, lambda meters: get_perplexity(meters[loss_key].avg))


def log_batch_metrics(ntokens: Any, nsentences: Any = None) -> None:
    """Task side (fairseq's ``FairseqTask.reduce_metrics``): ``wpb``, ``wps`` and ``bsz``.

    Call once per update in training and once per batch in validation (``wps`` is a
    speed meter: its first call only starts the clock).
    """
    if ntokens is not None:
        log_scalar("wpb", ntokens, priority=PRIORITY["wpb"], round=1)
        log_speed("wps", ntokens, priority=PRIORITY["wps"], round=1)
    if nsentences is not None:
        log_scalar("bsz", nsentences, priority=PRIORITY["bsz"], round=1)


def log_wall_start() -> None:
    """(Re)start the ``wall`` clock of the "default" aggregator.

    :func:`reset` (run at import) starts it, so ``get_meter("default", "wall")`` always
    exists; fairseq restarts it when the trainer is built. Restoring :func:`state_dict`
    continues the saved clock.
    """
    meters = _aggregators["default"]
    if "wall" not in meters:
        meters.add_meter("wall", StopwatchMeter(round=0), PRIORITY["wall"])
    meters["wall"].start()


def log_valid_metrics(
    ntokens: Any, nsentences: Any = None, num_batches: Optional[int] = None, elapsed: Optional[float] = None
) -> None:
    """Task side of a validation logged once from its totals (instead of per batch).

    Gives what fairseq's per-batch logging reports: ``wpb``/``bsz`` per batch
    (``ntokens``/``nsentences`` over ``num_batches``, the number of ``valid_step`` calls
    on one rank; default 1) and ``wps`` = ntokens / ``elapsed`` seconds (default: since
    the innermost ``aggregate()`` block, e.g. ``aggregate(new_root=True)``, was entered).
    """
    n = max(1, int(num_batches or 1))
    ntokens, nsentences = to_python(ntokens), to_python(nsentences)
    if elapsed is None:
        elapsed = _now() - _entry_times[-1] if _entry_times else 0.0
    if ntokens is not None:
        log_scalar("wpb", ntokens / n, weight=n, priority=PRIORITY["wpb"], round=1)
        for agg in get_active_aggregators():
            if "wps" not in agg:
                agg.add_meter("wps", TimeMeter(init=elapsed, n=ntokens, round=1), PRIORITY["wps"])
            else:
                agg["wps"].update(ntokens)
    if nsentences is not None:
        log_scalar("bsz", nsentences / n, weight=n, priority=PRIORITY["bsz"], round=1)


def log_update_metrics(
    num_updates: int,
    lr: Optional[float] = None,
    grad_norm: Any = None,
    clip_norm: float = 0.0,
    loss_scale: Optional[float] = None,
    gb_free: Optional[float] = None,
) -> None:
    """Trainer side of one update, with fairseq's priorities and rounding.

    ``num_updates`` and ``lr`` (weight 0), then, for a finite ``grad_norm``: ``ups``,
    ``gnorm`` and, with ``clip_norm > 0``, ``clip`` (100 when this update was clipped);
    ``loss_scale`` (pass it only with fp16) and ``gb_free`` (only on CUDA).
    """
    log_scalar("num_updates", num_updates, weight=0, priority=PRIORITY["num_updates"])
    if lr is not None:
        log_scalar("lr", lr, weight=0, priority=PRIORITY["lr"])
    if grad_norm is not None:
        finite = bool(torch.isfinite(grad_norm)) if isinstance(grad_norm, torch.Tensor) else math.isfinite(grad_norm)
        if finite:
            log_speed("ups", 1.0, priority=PRIORITY["ups"], round=2)
            log_scalar("gnorm", grad_norm, priority=PRIORITY["gnorm"], round=3)
            if clip_norm > 0:
                log_scalar(
                    "clip", 100.0 if to_python(grad_norm) > clip_norm else 0.0, priority=PRIORITY["clip"], round=1
                )
    if loss_scale is not None:
        log_scalar("loss_scale", loss_scale, priority=PRIORITY["loss_scale"], round=4, weight=0)
    if gb_free is not None:
        log_scalar("gb_free", gb_free, priority=PRIORITY["gb_free"], round=1, weight=0)


def log_standard_update_metrics(
    ntokens: Any,
    nsentences: Any,
    num_updates: int,
    lr: Optional[float] = None,
    grad_norm: Any = None,
    clip_norm: float = 0.0,
    loss_scale: Optional[float] = None,
    device: Optional[torch.device] = None,
    gb_free: Optional[float] = None,
) -> None:
    """Everything a trainer logs per update besides the criterion's loss/ppl.

    :func:`log_batch_metrics` (wpb/wps/bsz) + :func:`log_update_metrics`; on a CUDA
    ``device`` ``gb_free`` is measured (and the peak-memory counter reset) unless given.
    """
    log_batch_metrics(ntokens, nsentences)
    if gb_free is None and device is not None and torch.device(device).type == "cuda":
        from .throughput import cuda_gb_free

        gb_free = cuda_gb_free(device)
    log_update_metrics(
        num_updates, lr=lr, grad_norm=grad_norm, clip_norm=clip_norm, loss_scale=loss_scale, gb_free=gb_free
    )


def log_throughput(ntokens: Any, spec: ThroughputSpec) -> None:
    """Our ``tps`` (tokens/s per device, a speed meter) and derived ``mfu`` (percent) for one update.

    ``ntokens`` is the update's token count summed over ranks. Both are computed per
    aggregator, so a ``train_inner`` line reports its log interval and a ``train`` line the
    epoch; they come after fairseq's keys.
    """
    if ntokens is None:
        return
    log_speed("tps", float(to_python(ntokens)) / spec.world_size, priority=PRIORITY["tps"], round=1)
    if spec.peak_flops:
        fpt, peak = spec.flops_per_token, float(spec.peak_flops)
        log_derived(
            "mfu",
            lambda meters: mfu_percent(meters["tps"].avg, fpt, peak) if "tps" in meters else 0.0,
            priority=PRIORITY["mfu"],
        )


def mfu_percent(tokens_per_second: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation in percent, at most 100: a measured peak (CPU) is a sample that a
    long run can beat; a share of the peak above it would only say the sample read low."""
    return min(100.0, round(100.0 * tokens_per_second * flops_per_token / peak_flops, 2))


def get_training_stats(name_or_stats: Any = "train_inner") -> Dict[str, Any]:
    """Stats for a ``train_inner``/``train`` line: the aggregator's values plus ``wall``.

    As fairseq's ``get_training_stats``, ``wall`` (seconds since :func:`log_wall_start`,
    rounded to 0 digits) follows fairseq's keys; keys of our own (priority >=
    :data:`AFTER_WALL_PRIORITY`: ``tps``, ``mfu``) come after it. A dict may be given
    instead of a name; ``wall`` is then appended at its end.
    """
    wall = get_meter("default", "wall")
    wall_value = round(wall.elapsed_time, 0) if wall is not None else None
    if not isinstance(name_or_stats, str):
        stats = OrderedDict(name_or_stats)
        if wall_value is not None:
            stats["wall"] = wall_value
        return stats
    meters = _aggregators[name_or_stats]
    priorities = {key: pri for pri, _, key in meters.priorities}
    stats = OrderedDict()
    for key in meters.keys():
        if key.startswith("_"):
            continue
        if wall_value is not None and "wall" not in stats and priorities[key] >= AFTER_WALL_PRIORITY:
            stats["wall"] = wall_value
        stats[key] = meters.get_smoothed_value(key)
    if wall_value is not None and "wall" not in stats:
        stats["wall"] = wall_value
    return stats


def get_valid_stats(
    stats: Dict[str, Any],
    num_updates: int,
    best: Optional[float] = None,
    best_checkpoint_metric: str = "loss",
    maximize: bool = False,
) -> Dict[str, Any]:
    """fairseq's ``get_valid_stats``: append ``num_updates`` and, given the best value so far,
    ``best_<metric>`` = best of it and this validation's value."""
    stats = OrderedDict(stats)
    stats["num_updates"] = num_updates
    if best is not None and best_checkpoint_metric in stats:
        stats["best_" + best_checkpoint_metric] = (max if maximize else min)(best, stats[best_checkpoint_metric])
    return stats


reset()
