"""Argument types for fairseq's list-valued flags (``--lr 0.1,0.05``, ``--update-freq 2,4``).

A single value parses to a plain number, so code reading the flag as a number keeps
working; several values parse to a tuple, which :func:`toolkit.resolve` splits into the
first value and the per-epoch list.
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
