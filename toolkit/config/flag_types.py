"""Argument types: fairseq's list-valued flags (``--lr 0.1,0.05``, ``--update-freq 2,4``) and bounded counts.

A single value parses to a plain number, so code reading the flag as a number keeps
working; several values parse to a tuple, which :func:`toolkit.train.resolve` splits into the
first value and the per-epoch list.

The bounded counts refuse, at parse time, the values that would otherwise mean something
nobody asked for: ``--batch-size 0`` read as "no limit" (the host ran out of memory),
``--max-update -1`` as "train forever", ``--save-interval-updates -3`` as "off". Where
fairseq gives 0 or -1 a meaning (``--max-update 0`` = no limit, ``--keep-last-epochs -1`` =
keep all) that value stays accepted.
"""
from __future__ import annotations

import argparse
from typing import Callable, Tuple, Union


def _number_list(kind: Callable[[str], Union[int, float]], name: str):
    def parse(text: str):
        try:
            values = tuple(kind(v) for v in str(text).strip("[]() ").split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {name} list: {text!r} (e.g. 0.1 or 0.1,0.05)") from None
        if not values:
            raise argparse.ArgumentTypeError(f"invalid {name} list: {text!r}")
        return values[0] if len(values) == 1 else values

    parse.__name__ = f"{name}_list"
    return parse


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
count_or_zero = _bounded_int(0, " (0: no limit / off)")
count_or_minus_one = _bounded_int(-1, " (-1: off / keep all)")
