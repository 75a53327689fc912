"""Optimizers (``--optimizer``), learning-rate schedulers (``lr_scheduler/``) and the fp16 loss scaler.

Each optimizer module registers a factory ``build(cfg, params, lr) -> torch.optim.Optimizer``;
``build_optimizer`` resolves ``--optimizer`` and calls it.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from toolkit.optim.loss_scaler import DynamicLossScaler, default_scale_window, overflow_message
from toolkit.core.registry import OPTIMIZER_REGISTRY

__all__ = [
    "build_optimizer",
    "build_optimizer_from_section",
    "DynamicLossScaler",
    "default_scale_window",
    "overflow_message",
]


def build_optimizer_from_section(name: str, section: Any, params: Iterable, lr: Any) -> torch.optim.Optimizer:
    """The registered optimizer ``name`` with its own options ``section`` over ``params`` at ``lr``."""
    from toolkit.core.registry import import_submodules

    import_submodules(__name__)
    if isinstance(lr, (list, tuple)):  # fairseq's "--lr 0.1,0.05" form: the first value starts training
        lr = lr[0]
    return OPTIMIZER_REGISTRY.get(name).cls(section, list(params), float(lr))


def build_optimizer(values: Any, params: Iterable) -> torch.optim.Optimizer:
    """Build ``values["optimizer"]`` from a flat dict (or namespace) of options, e.g. in tests and scripts."""
    from toolkit.config.options import config_from_args
    from toolkit.core.registry import import_submodules

    import_submodules(__name__)
    values = values if isinstance(values, dict) else vars(values)
    name = values.get("optimizer") or OPTIMIZER_REGISTRY.default
    entry = OPTIMIZER_REGISTRY.get(name)
    section = config_from_args(entry.config, values) if entry.config is not None else None
    return build_optimizer_from_section(name, section, params, values.get("lr", 0.25))
