"""fairseq's criterion base class and decorator on the toolkit's registry: ``FairseqCriterion``,
``register_criterion``; and ``calls_the_model``, which tells fairseq's criterion contract from the toolkit's.

Why: a fairseq plugin's criterion ports by renaming the import; fairseq builds a criterion by filling
``__init__``'s parameters from its options by name, and the toolkit calls ``entry.cls(task, cfg)``,
so the registry holds a small builder that does fairseq's filling. A fairseq criterion runs the model itself
(``forward(model, sample, reduce)``), where the toolkit's trainer runs the model and hands a criterion its
outputs (``toolkit.core.protocols.Criterion``); the trainer asks ``calls_the_model`` which one it holds.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch.nn as nn

from toolkit.core import registry
from toolkit.core.protocols import Criterion
from toolkit.compat.fairseq.plugins.dataclass import with_enum_choices
from toolkit.compat.fairseq.plugins.legacy_args import legacy_config


def calls_the_model(criterion: Any) -> bool:
    """Whether ``criterion`` keeps fairseq's contract, ``criterion(model, sample, reduce)`` running the model itself,
    rather than the toolkit's (``toolkit.core.protocols.Criterion``: ``model_requests``, then
    ``criterion(net_output, sample, reduce)``): one without ``model_requests`` (a ``FairseqCriterion``), or a
    toolkit criterion's subclass whose ``forward`` takes the model first, as fairseq's do."""
    if not isinstance(criterion, Criterion):
        return True
    parameters = list(inspect.signature(getattr(criterion, "forward", criterion)).parameters)
    return bool(parameters) and parameters[0] == "model"


class FairseqCriterion(nn.Module):
    """fairseq's criterion base: ``forward(model, sample)`` runs the model -> (loss, sample_size, logging_output)."""

    def __init__(self, task):
        super().__init__()
        self.task = task
        dictionary = getattr(task, "target_dictionary", None)
        self.padding_idx = dictionary.pad() if dictionary is not None else -100

    @classmethod
    def add_args(cls, parser) -> None:
        """Legacy option declaration; dataclass criterions leave it alone."""

    @classmethod
    def build_criterion(cls, cfg: Any, task):
        """fairseq's rule: ``__init__``'s parameters are filled by name from ``task``, ``cfg`` and its fields."""
        init_args = {}
        for p in inspect.signature(cls).parameters.values():
            if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                raise NotImplementedError(f"{cls.__name__}: *args/**kwargs in __init__; implement build_criterion")
            if p.name == "task":
                init_args["task"] = task
            elif p.name == "cfg":
                init_args["cfg"] = cfg
            elif cfg is not None and hasattr(cfg, p.name):
                init_args[p.name] = getattr(cfg, p.name)
            elif p.default is p.empty:
                raise NotImplementedError(
                    f"{cls.__name__}: cannot fill __init__ argument {p.name!r} from the "
                    f"criterion's options; implement build_criterion"
                )
        return cls(**init_args)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return False


class _CriterionBuilder:
    """The registry's entry for a fairseq-style criterion: the toolkit calls it as ``entry.cls(task, cfg)``."""

    def __init__(self, criterion_class: type):
        self.wrapped_class = criterion_class

    def __call__(self, task, cfg: Any = None):
        return self.wrapped_class.build_criterion(cfg, task)

    def __getattr__(self, name: str):
        return getattr(self.wrapped_class, name)


def register_criterion(name: str, dataclass: Optional[type] = None):
    """fairseq's decorator: register a criterion class (options: ``dataclass`` or its ``add_args``)."""

    def decorator(cls):
        config = (
            with_enum_choices(dataclass)
            if dataclass
            else legacy_config(registry.CRITERION_REGISTRY, "criterion", name, cls, FairseqCriterion.add_args)
        )
        registry.CRITERION_REGISTRY.register(name, config)(_CriterionBuilder(cls))
        return cls

    return decorator
