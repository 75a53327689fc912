"""fairseq's task base classes and decorator on the toolkit's registry: ``FairseqTask``,
``LegacyFairseqTask``, ``register_task``, ``setup_task``.

Why: fairseq plugins register tasks with ``register_task`` and subclass ``FairseqTask`` /
``LegacyFairseqTask`` (or ``LanguageModelingTask``); with these names a plugin ports by renaming the
import. Options declared the legacy way (``add_args``) become flags (:mod:`toolkit.compat.fairseq.plugins.legacy_args`); a task
subclassing a registered task keeps its parent's options and adds its own.
"""

from __future__ import annotations

from typing import Any, Optional

from toolkit.core import registry
from toolkit.compat.fairseq.plugins.dataclass import with_enum_choices
from toolkit.data.dictionary import Dictionary
from toolkit.core.errors import UserError
from toolkit.compat.fairseq.plugins.legacy_args import legacy_config


class FairseqTask:
    """fairseq's task base: the generic class methods; data loading is the subclass's (or
    ``toolkit.tasks.language_modeling.LanguageModelingTask``'s, the usual parent of an LM task)."""

    @classmethod
    def add_args(cls, parser) -> None:
        """Legacy option declaration; dataclass tasks leave it alone."""

    def __init__(self, cfg: Any, **kwargs: Any):
        self.cfg = cfg
        self.datasets = {}

    @classmethod
    def setup_task(cls, cfg: Any, **kwargs: Any):
        return cls(cfg, **kwargs)

    @classmethod
    def load_dictionary(cls, filename: str) -> Dictionary:
        return Dictionary.load(filename)

    def dataset(self, split: str):
        if split not in self.datasets:
            raise KeyError(f"dataset not loaded: {split}")
        return self.datasets[split]

    def build_model(self, cfg: Any):
        arch = cfg.get("arch") if isinstance(cfg, dict) else getattr(cfg, "arch", None)
        if arch is None:
            raise UserError("build_model: the options name no --arch")
        return registry.build_model(arch, cfg, self)  # the models layer's, by name (it sits above this one)

    def build_criterion(self, cfg: Any):
        name = getattr(cfg, "criterion", None) or registry.CRITERION_REGISTRY.default
        entry = registry.CRITERION_REGISTRY.get(name)
        from toolkit.config import options

        return entry.cls(self, options.config_from_args(entry.config, cfg) if entry.config else None)

    def max_positions(self):
        return None

    @property
    def source_dictionary(self):
        raise NotImplementedError

    @property
    def target_dictionary(self):
        raise NotImplementedError


class LegacyFairseqTask(FairseqTask):
    """fairseq's base of tasks configured by ``add_args`` (``args`` rather than a dataclass)."""

    def __init__(self, args: Any):
        super().__init__(args)
        self.args = args


def register_task(name: str, dataclass: Optional[type] = None):
    """fairseq's decorator: register a task class (options: ``dataclass``, its ``add_args``, or its parent's)."""

    def decorator(cls):
        config = (
            with_enum_choices(dataclass)
            if dataclass
            else legacy_config(registry.TASK_REGISTRY, "task", name, cls, FairseqTask.add_args)
        )
        return registry.TASK_REGISTRY.register(name, config)(cls)

    return decorator


def setup_task(cfg: Any, **kwargs: Any):
    """fairseq's ``tasks.setup_task(cfg)``: the task ``cfg.task`` names (or ``cfg.task._name``), set up."""
    from toolkit.config import options

    registry.import_all_components()
    name = getattr(cfg, "task", None) or registry.TASK_REGISTRY.default
    if not isinstance(name, str):  # fairseq's hydra layout: cfg.task is a section with _name
        cfg, name = name, getattr(name, "_name", None) or registry.TASK_REGISTRY.default
    entry = registry.TASK_REGISTRY.get(name)
    values = cfg if isinstance(cfg, dict) else vars(cfg)  # None: not given (e.g. eval-lm's --tokens-per-sample,
    given = {k: v for k, v in values.items() if v is not None}  # which means "the checkpoint's"): the task's default
    section = options.config_from_args(entry.config, given) if entry.config is not None else cfg
    return entry.cls.setup_task(section, **kwargs)
