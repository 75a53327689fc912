"""``--optimizer nag``: fairseq's Nesterov accelerated gradient, with its weight decay and lr correction.

Per parameter ``p`` with gradient ``g``, momentum ``m`` and buffer ``buf`` (zero at first)::

    correct = lr / lr_old              # lr_old: the lr of this parameter's previous step
    p   *= 1 - lr * weight_decay
    p   += m * m * correct * buf - (1 + m) * lr * g
    buf  = m * correct * buf - lr * g

The buffer holds ``-lr * g`` terms; ``correct`` rescales them when the schedule changes the lr.
fairseq keeps ``lr_old`` per param group; here it is per parameter (the same value whenever
every parameter steps every update), so that stepping the parameters a chunk at a time
(``--memory-efficient-fp16``) or skipping a parameter without a gradient (LayerDrop) does not
lose the correction. Math in fp32 for fp16/bf16 parameters, as fairseq's.
"""

from __future__ import annotations


import torch

from toolkit.optim.sgd import check_momentum_options
from toolkit.core.registry import OptimizerState, ParameterPiece, register_optimizer
from toolkit.config.components import NAGConfig  # its options, torch-free for --help


class NAG(torch.optim.Optimizer):
    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, lr, momentum, weight_decay)
        return loss

    def _update(self, p: torch.Tensor, lr: float, momentum: float, weight_decay: float) -> None:
        state = self.state[p]
        half = (torch.float16, torch.bfloat16)
        g = p.grad.float() if p.grad.dtype in half else p.grad
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(g)
            state["lr_old"] = torch.tensor(lr, dtype=torch.float64)  # on the CPU: read without a device sync
        buf = state["momentum_buffer"]
        lr_old = float(state["lr_old"])
        correct = lr / lr_old if lr_old > 0 else lr
        p32 = p.float() if p.dtype in half else p
        if weight_decay != 0:
            p32.mul_(1 - lr * weight_decay)
        p32.add_(buf, alpha=momentum * momentum * correct)
        p32.add_(g, alpha=-(1 + momentum) * lr)
        buf.mul_(momentum * correct).add_(g, alpha=-lr)
        if p32 is not p:
            p.copy_(p32)
        state["lr_old"].fill_(lr)


def _nag_state_bytes(options: NAGConfig, piece: ParameterPiece) -> int:
    """NAG's fp32 buffer per tensor (its gradient's shape, upcast) and its float64 ``lr_old``."""
    return 4 * piece.local_numel + 8


@register_optimizer("nag", dataclass=NAGConfig, state=OptimizerState(_nag_state_bytes, lambda options: "nag"))
def build(cfg: NAGConfig, params: list, lr: float) -> torch.optim.Optimizer:
    check_momentum_options(cfg.momentum, cfg.weight_decay, lr)
    return NAG(list(params), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
