"""``--optimizer sgd``: torch's SGD with momentum and (L2) weight decay, as fairseq's sgd."""

from __future__ import annotations


import torch

from toolkit.core.errors import UserError
from toolkit.optim.adam import _all_params, _keep_implementation, fused_supported
from toolkit.core.registry import OptimizerState, ParameterPiece, register_optimizer
from toolkit.config.components import SGDConfig  # its options, torch-free for --help


def check_momentum_options(momentum: float, weight_decay: float, lr: float) -> None:
    """The checks of --optimizer sgd and nag (fairseq's options of both)."""
    if momentum < 0:
        raise UserError(f"--momentum: must be >= 0, got {momentum}")
    if weight_decay < 0:
        raise UserError(f"--weight-decay: must be >= 0, got {weight_decay}")
    if lr < 0:
        raise UserError(f"--lr: must be >= 0, got {lr}")


def _sgd_state_bytes(options: SGDConfig, piece: ParameterPiece) -> int:
    """torch SGD keeps an fp32 momentum buffer per tensor, and nothing at all without momentum."""
    return 4 * piece.local_numel if options.momentum else 0


@register_optimizer(
    "sgd",
    dataclass=SGDConfig,
    state=OptimizerState(_sgd_state_bytes, lambda options: "sgd" + (" (momentum)" if options.momentum else "")),
)
def build(cfg: SGDConfig, params: list, lr: float) -> torch.optim.Optimizer:
    check_momentum_options(cfg.momentum, cfg.weight_decay, lr)
    params = list(params)
    # fused is the fastest on CPU too (2 threads, 16.8M params: fused 7.0 ms, for-loop 16 ms, foreach 20 ms)
    # (torch has no DTensor rule for the fused SGD kernel: FSDP2's sharded parameters take foreach)
    plain = not any(hasattr(p, "to_local") for p in _all_params(params))
    kwargs = {"fused": True} if plain and fused_supported(_all_params(params)) else {"foreach": None}
    optimizer = torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, **kwargs)
    _keep_implementation(optimizer, kwargs)
    return optimizer
