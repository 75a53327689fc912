"""Meters: running statistics that the metrics aggregators keep, fairseq-compatible.

Every meter exposes ``smoothed_value`` (what gets logged), ``reset()``, and
``state_dict()``/``load_state_dict()`` holding plain Python values only, so a
checkpoint with meters loads with ``torch.load(..., weights_only=True)``.

Values may be logged as 0-d tensors (e.g. a grad norm still on the GPU); a meter
keeps them lazily as tensors and only turns them into Python numbers when a
smoothed value is read (at log time) or the state is saved, so logging every
update costs no device synchronisation.
"""

from __future__ import annotations

import bisect
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, Optional

import torch

__all__ = [
    "Meter",
    "AverageMeter",
    "SumMeter",
    "TimeMeter",
    "StopwatchMeter",
    "MetersDict",
    "safe_round",
    "to_python",
]


def to_python(x: Any) -> Any:
    """A one-element tensor or numpy scalar as a Python number; anything else unchanged."""
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    if hasattr(x, "item") and getattr(x, "ndim", None) == 0:  # numpy scalar
        return x.item()
    return x


def safe_round(number: Any, ndigits: Optional[int]) -> Any:
    """``round(number, ndigits)`` that also accepts 0-d tensors / numpy scalars (as fairseq's)."""
    if ndigits is None or number is None:
        return number
    number = to_python(number)
    if hasattr(number, "__round__"):
        return round(number, ndigits)
    return number


def _add(total: Any, value: Any) -> Any:
    """``total + value`` keeping a tensor on the value's device/dtype when one is a tensor."""
    if isinstance(total, torch.Tensor) and isinstance(value, torch.Tensor):
        total = total.to(value)
    return total + value


class Meter:
    """Base class: a statistic with a smoothed value for logging."""

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        pass

    def reset(self) -> None:
        raise NotImplementedError

    @property
    def smoothed_value(self) -> Any:
        raise NotImplementedError


class AverageMeter(Meter):
    """Weighted average of the logged values (weight 0 = "report the latest value")."""

    def __init__(self, round: Optional[int] = None):
        self.round = round
        self.reset()

    def reset(self) -> None:
        self.val = None  # most recent value
        self.sum = 0  # sum of value * weight
        self.count = 0  # sum of weights

    def update(self, val: Any, n: float = 1) -> None:
        if val is None:
            return
        self.val = val
        if n > 0:
            self.sum = _add(self.sum, val * n)
            self.count = self.count + n

    def state_dict(self) -> Dict[str, Any]:
        return {
            "val": to_python(self.val),
            "sum": to_python(self.sum),
            "count": to_python(self.count),
            "round": self.round,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.val = state_dict["val"]
        self.sum = state_dict["sum"]
        self.count = state_dict["count"]
        self.round = state_dict.get("round")

    @property
    def avg(self) -> Any:
        return self.sum / self.count if self.count > 0 else self.val

    @property
    def smoothed_value(self) -> Any:
        return to_python(safe_round(self.avg, self.round))


class SumMeter(Meter):
    """Sum of the logged values."""

    def __init__(self, round: Optional[int] = None):
        self.round = round
        self.reset()

    def reset(self) -> None:
        self.sum = 0

    def update(self, val: Any) -> None:
        if val is not None:
            self.sum = _add(self.sum, val)

    def state_dict(self) -> Dict[str, Any]:
        return {"sum": to_python(self.sum), "round": self.round}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.sum = state_dict["sum"]
        self.round = state_dict.get("round")

    @property
    def smoothed_value(self) -> Any:
        return to_python(safe_round(self.sum, self.round))


class TimeMeter(Meter):
    """Rate of some quantity per second since the last reset (e.g. words per second)."""

    def __init__(self, init: float = 0, n: float = 0, round: Optional[int] = None):
        self.round = round
        self.reset(init, n)

    def reset(self, init: float = 0, n: float = 0) -> None:
        self.init = init  # seconds already elapsed before ``start`` (restored runs)
        self.start = time.perf_counter()
        self.n = n
        self.i = 0

    def update(self, val: Any = 1) -> None:
        self.n = _add(self.n, val)
        self.i += 1

    def state_dict(self) -> Dict[str, Any]:
        return {"init": self.elapsed_time, "n": to_python(self.n), "round": self.round}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.reset(init=state_dict["init"], n=state_dict["n"])
        self.round = state_dict.get("round")

    @property
    def elapsed_time(self) -> float:
        return self.init + (time.perf_counter() - self.start)

    @property
    def avg(self) -> Any:
        elapsed = self.elapsed_time
        return self.n / elapsed if elapsed > 0 else 0.0

    @property
    def smoothed_value(self) -> Any:
        return to_python(safe_round(self.avg, self.round))


class StopwatchMeter(Meter):
    """Total (or, with weights, average) duration of an event in seconds.

    ``start()`` ... ``stop(n)`` adds the time in between to ``sum`` and ``n`` to the
    count; with ``n=0`` (the default of ``metrics.log_stop_time``) the smoothed value
    is the total time. A stopwatch that was started but never stopped (the ``wall``
    clock) reports the time since ``start()``; that elapsed time survives
    ``state_dict()``/``load_state_dict()``, so the wall clock continues across a resume.
    """

    def __init__(self, round: Optional[int] = None):
        self.round = round
        self.sum = 0
        self.n = 0
        self.start_time: Optional[float] = None

    def start(self) -> None:
        self.start_time = time.perf_counter()

    def stop(self, n: float = 1, prehook: Optional[Callable[[], None]] = None) -> None:
        if self.start_time is not None:
            if prehook is not None:
                prehook()
            self.sum = self.sum + (time.perf_counter() - self.start_time)
            self.n = self.n + n

    def reset(self) -> None:
        self.sum = 0
        self.n = 0
        self.start()

    def state_dict(self) -> Dict[str, Any]:
        elapsed = None if self.start_time is None else self.elapsed_time
        return {"sum": to_python(self.sum), "n": to_python(self.n), "round": self.round, "elapsed": elapsed}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.sum = state_dict["sum"]
        self.n = state_dict["n"]
        self.round = state_dict.get("round")
        elapsed = state_dict.get("elapsed")
        self.start_time = None if elapsed is None else time.perf_counter() - elapsed

    @property
    def avg(self) -> float:
        return self.sum / self.n if self.n > 0 else self.sum

    @property
    def elapsed_time(self) -> float:
        if self.start_time is None:
            return 0.0
        return time.perf_counter() - self.start_time

    @property
    def smoothed_value(self) -> Any:
        val = self.avg if self.sum > 0 else self.elapsed_time
        return to_python(safe_round(val, self.round))


class MetersDict(OrderedDict):
    """An ordered dict of meters, kept sorted by the priority given when a meter is added.

    Smaller priorities come first; equal priorities keep the order they were added in.
    Keys starting with ``_`` are hidden from :meth:`get_smoothed_values`.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.priorities = []  # sorted list of (priority, insertion index, key)

    def __setitem__(self, key, value):
        assert key not in self, "MetersDict doesn't support reassignment"
        priority, meter = value
        bisect.insort(self.priorities, (priority, len(self.priorities), key))
        super().__setitem__(key, meter)
        for _, _, k in self.priorities:  # reorder to match the priorities
            self.move_to_end(k)

    def add_meter(self, key: str, meter: Meter, priority: float) -> None:
        self.__setitem__(key, (priority, meter))

    def priority(self, key: str) -> float:
        for pri, _, k in self.priorities:
            if k == key:
                return pri
        raise KeyError(key)

    def state_dict(self):
        """[(priority, key, meter class name, meter state), ...] without derived meters."""
        return [
            (pri, key, type(self[key]).__name__, self[key].state_dict())
            for pri, _, key in self.priorities
            if not isinstance(self[key], MetersDict._DerivedMeter)
        ]

    def load_state_dict(self, state_dict) -> None:
        self.clear()
        self.priorities.clear()
        for pri, key, meter_cls, meter_state in state_dict:
            if meter_cls not in METER_CLASSES:
                raise ValueError(f"unknown meter class {meter_cls!r} in metrics state")
            meter = METER_CLASSES[meter_cls]()
            meter.load_state_dict(meter_state)
            self.add_meter(key, meter, pri)

    def get_smoothed_value(self, key: str) -> Any:
        meter = self[key]
        if isinstance(meter, MetersDict._DerivedMeter):
            return to_python(meter.fn(self))
        return meter.smoothed_value

    def get_smoothed_values(self) -> Dict[str, Any]:
        return OrderedDict((key, self.get_smoothed_value(key)) for key in self.keys() if not key.startswith("_"))

    def reset(self) -> None:
        for meter in self.values():
            if not isinstance(meter, MetersDict._DerivedMeter):
                meter.reset()

    class _DerivedMeter(Meter):
        """A value computed from the other meters of the same dict (e.g. perplexity)."""

        def __init__(self, fn: Callable[[MetersDict], Any]):
            self.fn = fn

        def reset(self) -> None:
            pass


METER_CLASSES = {cls.__name__: cls for cls in (AverageMeter, SumMeter, TimeMeter, StopwatchMeter)}
