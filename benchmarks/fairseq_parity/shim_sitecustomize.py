"""Python 3.11 / numpy 2 shims for fairseq / hydra-core 1.0: Python 3.11 refuses an unhashable dataclass instance as a
field default (3.10 accepted it). Give such default classes identity hashing, which restores 3.10's behaviour."""

import dataclasses

_orig = dataclasses._get_field


def _get_field(cls, a_name, a_type, *rest):
    default = cls.__dict__.get(a_name, dataclasses.MISSING)
    if isinstance(default, dataclasses.Field):
        default = default.default
    if dataclasses.is_dataclass(default) and not isinstance(default, type) and type(default).__hash__ is None:
        type(default).__hash__ = object.__hash__
    return _orig(cls, a_name, a_type, *rest)


dataclasses._get_field = _get_field

# numpy 2 removed numpy.compat; fairseq's TokenBlockDataset (--sample-break-mode eos) still reads
# numpy.compat.long, which numpy 1.x defined as the builtin int.
import types as _types  # noqa: E402

import numpy as _numpy  # noqa: E402

if not hasattr(_numpy, "compat"):
    _numpy.compat = _types.SimpleNamespace(long=int)
