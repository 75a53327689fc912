"""Optimizers (``--optimizer``), learning-rate schedulers (``lr_scheduler/``) and the fp16 loss scaler.

Each optimizer module registers a factory ``build(cfg, params, lr) -> torch.optim.Optimizer``;
``build_optimizer`` resolves ``--optimizer`` and calls it.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from toolkit.optim.loss_scaler import DynamicLossScaler, default_scale_window, overflow_message
from toolkit.registry import OPTIMIZER_REGISTRY

__all__ = ["build_optimizer", "DynamicLossScaler", "default_scale_window", "overflow_message"]


def build_optimizer(args: Any, params: Iterable) -> torch.optim.Optimizer:
    """Build ``args.optimizer`` (namespace or dict) over ``params`` (tensors or param-group dicts), lr ``args.lr``."""
    from toolkit.options import config_from_args
    from toolkit.registry import import_submodules

    import_submodules(__name__)
    values = args if isinstance(args, dict) else vars(args)
    name = values.get("optimizer") or OPTIMIZER_REGISTRY.default
    entry = OPTIMIZER_REGISTRY.get(name)
    cfg = config_from_args(entry.config, values) if entry.config is not None else None
    lr = values.get("lr", 0.25)
    if isinstance(lr, (list, tuple)):  # fairseq's "--lr 0.1,0.05" form: the first value starts training
        lr = lr[0]
    return entry.cls(cfg, list(params), float(lr))
