"""``torch.distributed.checkpoint``'s state-dict functions and module, imported at their first use.

Importing DCP costs about a second on an idle machine (it brings DTensor, sympy and FX with it), and
every command, spawned rank and test process paid it at start-up although most runs never save a
sharded checkpoint (``benchmarks/startup.py`` measures it). The checkpoint code imports these names
from here instead of from torch: the same functions, called with the same arguments, the real module
loaded on the first call. ``StateDictOptions(...)`` is recorded and built at that call too.
"""

from __future__ import annotations

import importlib
from typing import Any


def _state_dict_module():
    return importlib.import_module("torch.distributed.checkpoint.state_dict")


class StateDictOptions:
    """The keyword arguments of torch's ``StateDictOptions``; the real options are built when used."""

    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs

    def build(self):
        return _state_dict_module().StateDictOptions(**self.kwargs)

    def __getattr__(self, name: str) -> Any:
        """The real options' fields (``FULL_STATE.cpu_offload``), as if it were one."""
        if name == "kwargs":
            raise AttributeError(name)
        return getattr(self.build(), name)


def _call(name: str, args, kwargs):
    options = kwargs.get("options")
    if isinstance(options, StateDictOptions):
        kwargs = {**kwargs, "options": options.build()}
    return getattr(_state_dict_module(), name)(*args, **kwargs)


def get_model_state_dict(*args: Any, **kwargs: Any):
    return _call("get_model_state_dict", args, kwargs)


def get_optimizer_state_dict(*args: Any, **kwargs: Any):
    return _call("get_optimizer_state_dict", args, kwargs)


def set_model_state_dict(*args: Any, **kwargs: Any):
    return _call("set_model_state_dict", args, kwargs)


def set_optimizer_state_dict(*args: Any, **kwargs: Any):
    return _call("set_optimizer_state_dict", args, kwargs)


class _Module:
    """``torch.distributed.checkpoint`` (``dcp.save``, ``dcp.FileSystemWriter``, ...) imported on first access."""

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("torch.distributed.checkpoint"), name)


dcp = _Module()


def dcp_failure(error: BaseException) -> bool:
    """Whether ``error`` is DCP's ``CheckpointException`` (a BaseException wrapping every rank's failure),
    without importing DCP: none can have been raised before it was imported."""
    import sys

    api = sys.modules.get("torch.distributed.checkpoint.api")
    return api is not None and isinstance(error, api.CheckpointException)
