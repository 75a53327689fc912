"""Driving an optimizer by hand with given gradients, so two implementations see the same steps."""

from __future__ import annotations

import torch


def run_steps(opt, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)


def new_params(init):
    return [torch.nn.Parameter(t.clone()) for t in init]
