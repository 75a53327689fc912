"""Progress bars that write fairseq's log lines (json | simple | tqdm | none) and TensorBoard.

``bar.log(stats, tag, step)`` writes a mid-epoch line (every ``log_interval``
updates) and ``bar.print(stats, tag, step)`` an end-of-epoch / validation line.
The logger name shown in the line is the ``tag`` (train_inner, valid, train): the
module logger is renamed while the line is written, as fairseq does. Numbers are
formatted with ``"{:g}"`` (after the meters' rounding) and written as strings::

    2021-03-08 12:31:36 | INFO | train_inner | {"epoch": 1, "update": 0.0, "loss": "16.475", ...}
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
from collections import OrderedDict
from numbers import Number
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, Optional

import torch

from .setup import add_file_handler
from .meters import AverageMeter, StopwatchMeter, TimeMeter

if TYPE_CHECKING:
    from toolkit.config import CommonConfig

logger = logging.getLogger(__name__)

LOG_FORMATS = ("json", "simple", "tqdm", "none")


def progress_bar(
    iterator: Iterable,
    log_format: Optional[str] = None,
    log_interval: int = 100,
    epoch: Optional[int] = None,
    prefix: Optional[str] = None,
    tensorboard_logdir: Optional[str] = None,
    default_log_format: str = "tqdm",
    log_file: Optional[str] = None,
) -> BaseProgressBar:
    """Wrap ``iterator`` in a progress bar of ``log_format`` (default ``default_log_format``).

    tqdm falls back to simple when stderr is not a terminal. With ``tensorboard_logdir``
    (pass it on rank 0 only) the same scalars go to ``<logdir>/<tag>``. ``log_file`` also
    sends the log (all of it, fairseq's format) to that file.
    """
    if log_format is None:
        log_format = default_log_format
    if log_file is not None:
        add_file_handler(log_file)
    if log_format == "tqdm" and not sys.stderr.isatty():
        log_format = "simple"

    if log_format == "json":
        bar: BaseProgressBar = JsonProgressBar(iterator, epoch, prefix, log_interval)
    elif log_format == "none":
        bar = NoopProgressBar(iterator, epoch, prefix)
    elif log_format == "simple":
        bar = SimpleProgressBar(iterator, epoch, prefix, log_interval)
    elif log_format == "tqdm":
        bar = TqdmProgressBar(iterator, epoch, prefix)
    else:
        raise ValueError(f"unknown log format: {log_format!r} (choose from {', '.join(LOG_FORMATS)})")

    if tensorboard_logdir:
        bar = TensorboardProgressBarWrapper(bar, tensorboard_logdir)
    return bar


def build_progress_bar(
    common: CommonConfig,
    iterator: Iterable,
    epoch: Optional[int] = None,
    prefix: Optional[str] = None,
    is_master: bool = True,
) -> BaseProgressBar:
    """:func:`progress_bar` from the common options (--log-format, --log-interval, ...).

    As fairseq: the default format is tqdm (simple off a terminal) or simple with
    --no-progress-bar; TensorBoard is written by the master rank only.
    """
    return progress_bar(
        iterator,
        log_format=common.log_format,
        log_interval=common.log_interval,
        epoch=epoch,
        prefix=prefix,
        tensorboard_logdir=common.tensorboard_logdir if is_master else None,
        default_log_format="simple" if common.no_progress_bar else "tqdm",
    )


def format_stat(stat: Any) -> Any:
    """fairseq's formatting of one value: numbers with ``"{:g}"``, meters by their average."""
    if isinstance(stat, Number):
        stat = f"{stat:g}"
    elif isinstance(stat, AverageMeter):
        stat = f"{stat.avg:.3f}"
    elif isinstance(stat, TimeMeter):
        stat = f"{round(stat.avg):g}"
    elif isinstance(stat, StopwatchMeter):
        stat = f"{round(stat.sum):g}"
    elif isinstance(stat, torch.Tensor):
        stat = stat.tolist()
        if isinstance(stat, Number):
            stat = f"{stat:g}"
    return stat


@contextlib.contextmanager
def rename_logger(log: logging.Logger, new_name: Optional[str]) -> Iterator[logging.Logger]:
    old_name = log.name
    if new_name is not None:
        log.name = new_name
    try:
        yield log
    finally:
        log.name = old_name


class BaseProgressBar:
    """Iterates over ``iterable``; ``log``/``print`` write stats lines."""

    def __init__(self, iterable: Iterable, epoch: Optional[int] = None, prefix: Optional[str] = None):
        self.iterable = iterable
        self.n = getattr(iterable, "n", 0)  # resume offset of a counting iterator
        self.epoch = epoch
        self.prefix = ""
        if epoch is not None:
            self.prefix += f"epoch {epoch:03d}"
        if prefix is not None:
            self.prefix += (" | " if self.prefix != "" else "") + prefix

    def __len__(self) -> int:
        return len(self.iterable)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __iter__(self):
        raise NotImplementedError

    def log(self, stats: Dict[str, Any], tag: Optional[str] = None, step: Optional[int] = None) -> None:
        """Log intermediate stats (every ``log_interval`` steps)."""
        raise NotImplementedError

    def print(self, stats: Dict[str, Any], tag: Optional[str] = None, step: Optional[int] = None) -> None:
        """Print end-of-epoch (or validation) stats."""
        raise NotImplementedError

    def update_config(self, config: Any) -> None:
        pass

    def _str_commas(self, stats: Dict[str, str]) -> str:
        return ", ".join(key + "=" + stats[key].strip() for key in stats.keys())

    def _str_pipes(self, stats: Dict[str, str]) -> str:
        return " | ".join(key + " " + stats[key].strip() for key in stats.keys())

    def _format_stats(self, stats: Dict[str, Any]) -> OrderedDict[str, str]:
        return OrderedDict((key, str(format_stat(value))) for key, value in stats.items())


def _safe_len(iterable: Iterable) -> Optional[int]:
    try:
        return len(iterable)  # type: ignore[arg-type]
    except TypeError:
        return None


class IntervalProgressBar(BaseProgressBar):
    """A bar that writes a line every ``log_interval`` updates and tracks its position for them."""

    def __init__(self, iterable, epoch=None, prefix=None, log_interval=1000):
        super().__init__(iterable, epoch, prefix)
        self.log_interval = log_interval
        self.i: Optional[int] = None
        self.size: Optional[int] = None

    def __iter__(self):
        self.size = _safe_len(self.iterable)
        for i, obj in enumerate(self.iterable, start=self.n):
            self.i = i
            yield obj


class JsonProgressBar(IntervalProgressBar):
    """One JSON object per line: ``{"epoch": 1, "update": 0.25, "loss": "3.2", ...}``."""

    def log(self, stats, tag=None, step=None):
        step = step or self.i or 0
        if step > 0 and self.log_interval is not None and step % self.log_interval == 0:
            update = None
            if self.epoch is not None and self.size and self.i is not None:
                update = self.epoch - 1 + (self.i + 1) / float(self.size)
            stats = self._format_json_stats(stats, epoch=self.epoch, update=update)
            with rename_logger(logger, tag):
                logger.info(json.dumps(stats))

    def print(self, stats, tag=None, step=None):
        if tag is not None:
            stats = OrderedDict((tag + "_" + k, v) for k, v in stats.items())
        stats = self._format_json_stats(stats, epoch=self.epoch)
        with rename_logger(logger, tag):
            logger.info(json.dumps(stats))

    def _format_json_stats(self, stats, epoch=None, update=None):
        postfix: Dict[str, Any] = OrderedDict()
        if epoch is not None:
            postfix["epoch"] = epoch
        if update is not None:
            postfix["update"] = round(update, 3)
        for key in stats.keys():
            postfix[key] = format_stat(stats[key])
        return postfix


class NoopProgressBar(BaseProgressBar):
    """No output."""

    def __iter__(self):
        yield from self.iterable

    def log(self, stats, tag=None, step=None):
        pass

    def print(self, stats, tag=None, step=None):
        pass


class SimpleProgressBar(IntervalProgressBar):
    """Plain lines for non-terminals: ``epoch 001:    100 / 1000 loss=3.2, ppl=9.19, ...``."""

    def log(self, stats, tag=None, step=None):
        step = step or self.i or 0
        if step > 0 and self.log_interval is not None and step % self.log_interval == 0:
            postfix = self._str_commas(self._format_stats(stats))
            i = (self.i + 1) if self.i is not None else step
            size = self.size if self.size is not None else 0
            with rename_logger(logger, tag):
                logger.info(f"{self.prefix}:  {i:5d} / {size:d} {postfix}")

    def print(self, stats, tag=None, step=None):
        postfix = self._str_pipes(self._format_stats(stats))
        with rename_logger(logger, tag):
            logger.info(f"{self.prefix} | {postfix}")


class TqdmProgressBar(BaseProgressBar):
    """A tqdm bar on stderr whose postfix shows the latest stats; ``print`` writes a log line."""

    def __init__(self, iterable, epoch=None, prefix=None):
        super().__init__(iterable, epoch, prefix)
        from tqdm import tqdm

        self.tqdm = tqdm(iterable, self.prefix, leave=False, disable=(logger.getEffectiveLevel() > logging.INFO))

    def __iter__(self):
        return iter(self.tqdm)

    def log(self, stats, tag=None, step=None):
        self.tqdm.set_postfix(self._format_stats(stats), refresh=False)

    def print(self, stats, tag=None, step=None):
        postfix = self._str_pipes(self._format_stats(stats))
        with rename_logger(logger, tag):
            logger.info(f"{self.prefix} | {postfix}")

    def __exit__(self, *exc):
        self.tqdm.close()
        return False


# --- TensorBoard ------------------------------------------------------------------------

_tensorboard_writers: Dict[tuple, Any] = {}


def _summary_writer_cls():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


def close_tensorboard_writers() -> None:
    """Flush and close every TensorBoard writer (also done at exit)."""
    for writer in _tensorboard_writers.values():
        writer.close()
    _tensorboard_writers.clear()


atexit.register(close_tensorboard_writers)


class TensorboardProgressBarWrapper(BaseProgressBar):
    """Also writes the numeric stats to TensorBoard: one SummaryWriter per tag, in ``<logdir>/<tag>``."""

    def __init__(self, wrapped_bar: BaseProgressBar, tensorboard_logdir: str):
        self.wrapped_bar = wrapped_bar
        self.tensorboard_logdir = tensorboard_logdir
        self._writer_cls = _summary_writer_cls()
        if self._writer_cls is None:
            logger.warning("tensorboard not found, please install with: pip install tensorboard")

    def __getattr__(self, name):  # epoch, prefix, n, ... of the wrapped bar
        if name == "wrapped_bar":
            raise AttributeError(name)
        return getattr(self.wrapped_bar, name)

    def __len__(self):
        return len(self.wrapped_bar)

    def __iter__(self):
        return iter(self.wrapped_bar)

    def __exit__(self, *exc):
        return self.wrapped_bar.__exit__(*exc)

    def _writer(self, key: str):
        if self._writer_cls is None:
            return None
        ident = (os.path.abspath(self.tensorboard_logdir), key)
        if ident not in _tensorboard_writers:
            writer = self._writer_cls(os.path.join(self.tensorboard_logdir, key))
            writer.add_text("sys.argv", " ".join(sys.argv))
            _tensorboard_writers[ident] = writer
        return _tensorboard_writers[ident]

    def log(self, stats, tag=None, step=None):
        self._log_to_tensorboard(stats, tag, step)
        self.wrapped_bar.log(stats, tag=tag, step=step)

    def print(self, stats, tag=None, step=None):
        self._log_to_tensorboard(stats, tag, step)
        self.wrapped_bar.print(stats, tag=tag, step=step)

    def update_config(self, config):
        self.wrapped_bar.update_config(config)

    def _log_to_tensorboard(self, stats, tag=None, step=None):
        writer = self._writer(tag or "")
        if writer is None:
            return
        if step is None:
            step = stats["num_updates"]
        for key, value in stats.items():
            if key == "num_updates":
                continue
            if isinstance(value, AverageMeter):
                value = value.val
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, Number) and not isinstance(value, bool):
                writer.add_scalar(key, value, step)
        writer.flush()
