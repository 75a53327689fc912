"""Argument types: fairseq's list-valued flags (``--lr 0.1,0.05``, ``--update-freq 2,4``) and bounded counts.

A single value parses to a plain number, so code reading the flag as a number keeps
working; several values parse to a tuple, which :func:`toolkit.train.resolve` splits into the
first value and the per-epoch list.

The bounded counts refuse, at parse time, the values that would otherwise mean something
nobody asked for: ``--batch-size 0`` read as "no limit" (the host ran out of memory),
``--max-update -1`` as "train forever", ``--save-interval-updates -3`` as "off". Where
fairseq gives 0 or -1 a meaning (``--max-update 0`` = no limit, ``--keep-last-epochs -1`` =
keep all) that value stays accepted.

No float flag takes ``nan`` or ``inf`` (``float`` parses both): an options dataclass's float field
without its own type is a :func:`finite_float`, and the bounded floats (:func:`positive_float`,
:func:`share`, ...) say what else a value must be (``--compute-efficiency 5`` is not a share of a peak).
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, Optional, Tuple, Union


def _number_list(kind: Callable[[str], Union[int, float]], name: str):
    def parse(text: str):
        try:
            values = tuple(kind(v) for v in str(text).strip("[]() ").split(",") if v.strip())
            if not all(math.isfinite(v) for v in values):
                raise argparse.ArgumentTypeError(f"{text}: every value must be a finite number (not nan or inf)")
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {name} list: {text!r} (e.g. 0.1 or 0.1,0.05)") from None
        if not values:
            raise argparse.ArgumentTypeError(f"invalid {name} list: {text!r}")
        return values[0] if len(values) == 1 else values

    parse.__name__ = f"{name}_list"
    return parse


def bounded_float(
    low: Optional[float] = None,
    high: Optional[float] = None,
    low_open: bool = False,
    high_open: bool = False,
    meaning: str = "",
):
    """A float flag type: finite, within [low, high] (``low_open``/``high_open``: the end itself excluded)."""
    lower = "" if low is None else ("(" if low_open else "[") + f"{low:g}"
    upper = "" if high is None else f"{high:g}" + (")" if high_open else "]")
    bounds = (
        f"in {lower}, {upper}"
        if low is not None and high is not None
        else (
            f"{'greater than' if low_open else 'at least'} {low:g}"
            if low is not None
            else f"{'less than' if high_open else 'at most'} {high:g}"
            if high is not None
            else ""
        )
    )

    def parse(text: str) -> float:
        try:
            value = float(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text}: must be a finite number (not nan or inf)")
        if (
            low is not None
            and (value < low or (low_open and value == low))
            or high is not None
            and (value > high or (high_open and value == high))
        ):
            raise argparse.ArgumentTypeError(f"{value:g}: must be {bounds}{meaning}")
        return value

    parse.__name__ = "float" if not bounds else f"float_{bounds}".replace(" ", "_")
    return parse


finite_float = bounded_float()
positive_float = bounded_float(0.0, low_open=True)
non_negative_float = bounded_float(0.0)
share = bounded_float(0.0, 1.0, low_open=True, meaning=" (a share: 1 is all of it)")
probability = bounded_float(0.0, 1.0, high_open=True, meaning=" (a probability; 1 would drop everything)")

float_list = _number_list(float, "float")
int_list = _number_list(int, "int")


def as_tuple(value) -> Tuple:
    """A flag value parsed by :func:`float_list`/:func:`int_list` (or a plain number) as a tuple."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def for_epoch(values: Tuple, epoch: int):
    """fairseq's per-epoch choice: epoch e (from 1) takes the e-th value, the last one repeats."""
    return values[min(max(epoch, 1), len(values)) - 1]


def _bounded_int(minimum: int, meaning: str):
    """An int flag type refusing values below ``minimum`` (``meaning`` says what the smallest one does)."""

    def parse(text: str) -> int:
        try:
            value = int(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value}: must be at least {minimum}{meaning}")
        return value

    parse.__name__ = f"int_at_least_{minimum}".replace("-", "minus_")
    return parse


positive_int = _bounded_int(1, "")
non_negative_int = _bounded_int(0, "")
count_or_zero = _bounded_int(0, " (0: no limit / off)")
count_or_minus_one = _bounded_int(-1, " (-1: off / keep all)")


def example_limit(text: str) -> float:
    """``--limit`` (toolkit-eval-harness): a fraction of each task in (0, 1), else a whole number of examples
    (refused at parse time: the harness would evaluate nothing for 0 and everything but the last 3 for -3)."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not (0 < value < 1 or (math.isfinite(value) and value >= 1 and value == int(value))):
        raise argparse.ArgumentTypeError(f"{text}: give a fraction between 0 and 1 or a whole number of examples >= 1")
    return value
