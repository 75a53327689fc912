"""``--optimizer nag`` and ``--lr-scheduler reduce_lr_on_plateau`` against fairseq's update rules,
written out here (fairseq/optim/nag.py, fairseq/optim/lr_scheduler/reduce_lr_on_plateau.py)."""

from __future__ import annotations

import pytest
import torch

from toolkit.core.errors import UserError
from toolkit.optim import build_optimizer
from toolkit.optim.fp16 import MemoryEfficientFP16
from toolkit.optim.lr_scheduler import build_lr_scheduler

SHAPES = [(6, 4), (5,)]


def data(steps=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    grads = [[torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES] for _ in range(steps)]
    lrs = [0.1 * (0.7 ** (t // 3)) for t in range(steps)]  # the schedule changes the lr every 3 steps
    return init, grads, lrs


def fairseq_nag_reference(init, grads, lrs, momentum, weight_decay):
    """fairseq's NAG: lr_correct = lr / lr_old; p *= 1 - lr*wd; p += m^2*correct*buf - (1+m)*lr*g;
    buf = m*correct*buf - lr*g; lr_old = lr."""
    params = [p.clone() for p in init]
    bufs = [torch.zeros_like(p) for p in params]
    lr_old = lrs[0]
    for step_grads, lr in zip(grads, lrs):
        correct = lr / lr_old
        for p, buf, g in zip(params, bufs, step_grads):
            p.mul_(1 - lr * weight_decay)
            p.add_(momentum * momentum * correct * buf - (1 + momentum) * lr * g)
            buf.mul_(momentum * correct).sub_(lr * g)
        lr_old = lr
    return params


def run_nag(init, grads, lrs, momentum, weight_decay, dtype=torch.float64, chunked=False):
    params = [torch.nn.Parameter(p.clone().to(dtype)) for p in init]
    opt = build_optimizer(dict(optimizer="nag", lr=lrs[0], momentum=momentum, weight_decay=weight_decay), params)
    stepper = MemoryEfficientFP16(opt, chunk_numel=1) if chunked else None
    for step_grads, lr in zip(grads, lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        for p, g in zip(params, step_grads):
            p.grad = g.to(dtype)
        stepper.step() if stepper else opt.step()
        opt.zero_grad(set_to_none=True)
    return params, opt


@pytest.mark.parametrize("momentum,weight_decay", [(0.99, 0.0), (0.9, 0.01)])
def test_nag_is_fairseqs_update(momentum, weight_decay):
    init, grads, lrs = data()
    want = fairseq_nag_reference(init, grads, lrs, momentum, weight_decay)
    got, _ = run_nag(init, grads, lrs, momentum, weight_decay)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.detach(), b, rtol=1e-12, atol=1e-12)
    # stepped one parameter at a time (memory-efficient fp16's chunks): the lr correction still holds
    got, _ = run_nag(init, grads, lrs, momentum, weight_decay, dtype=torch.float32, chunked=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.detach().double(), b, rtol=1e-5, atol=1e-5)


def test_nag_fp16_parameters_step_in_fp32_and_state_round_trips():
    init, grads, lrs = data(steps=6)
    want = fairseq_nag_reference(init, grads, lrs, 0.99, 0.0)
    got, _ = run_nag(init, grads, lrs, 0.99, 0.0, dtype=torch.bfloat16)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.detach().double(), b, rtol=3e-2, atol=3e-2)
    # resume from a state dict after 3 steps: the same as running 6
    first, opt = run_nag(init, grads[:3], lrs[:3], 0.99, 0.0)
    params = [torch.nn.Parameter(p.detach().clone()) for p in first]
    resumed = build_optimizer(dict(optimizer="nag", lr=lrs[3], momentum=0.99), params)
    resumed.load_state_dict(opt.state_dict())
    for step_grads, lr in zip(grads[3:], lrs[3:]):
        for group in resumed.param_groups:
            group["lr"] = lr
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        resumed.step()
    for a, b in zip(params, want):
        torch.testing.assert_close(a.detach(), b, rtol=1e-12, atol=1e-12)


def test_nag_bad_flags():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(UserError, match="--momentum"):
        build_optimizer(dict(optimizer="nag", lr=1.0, momentum=-0.1), p)
    with pytest.raises(UserError, match="--weight-decay"):
        build_optimizer(dict(optimizer="nag", lr=1.0, weight_decay=-1.0), p)


# ---- reduce_lr_on_plateau ----


def plateau_reference(lr, shrink, threshold, patience, losses, maximize=False):
    """torch/fairseq ReduceLROnPlateau (rel threshold, no cooldown): lr after each epoch's validation."""
    best, bad, out = None, 0, []
    for loss in losses:
        better = best is None or (loss > best * (1 + threshold) if maximize else loss < best * (1 - threshold))
        if better:
            best, bad = loss, 0
        else:
            bad += 1
        if bad > patience:
            lr, bad = lr * shrink, 0
        out.append(lr)
    return out


def scheduler(**kw):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=123.0)
    return build_lr_scheduler(dict(lr_scheduler="reduce_lr_on_plateau", **kw), opt), opt


@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("patience", [0, 2])
def test_plateau_shrinks_after_patience_epochs_without_improvement(patience, maximize):
    losses = [5.0, 4.0, 4.0, 3.9999, 4.1, 3.0, 3.0, 3.0, 3.0, 2.0, 2.5, 2.5, 2.5]
    if maximize:
        losses = [10 - v for v in losses]
    s, opt = scheduler(
        lr=1.0, lr_shrink=0.5, lr_threshold=1e-4, lr_patience=patience, maximize_best_checkpoint_metric=maximize
    )
    assert opt.param_groups[0]["lr"] == 1.0  # no warmup: starts at --lr
    want = plateau_reference(1.0, 0.5, 1e-4, patience, losses, maximize)
    got = [s.step(epoch, loss) for epoch, loss in enumerate(losses, start=1)]
    assert got == pytest.approx(want, rel=1e-12)
    assert min(got) < 1.0


def test_plateau_warmup_is_linear_and_ignores_validation_until_it_ends():
    s, opt = scheduler(lr=1.0, lr_shrink=0.5, warmup_updates=10, warmup_init_lr=0.1)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    for n in (0, 1, 5, 10):
        assert s.step_update(n) == pytest.approx(0.1 + n * (1.0 - 0.1) / 10, rel=1e-12)
    assert s.step(1, 5.0) == pytest.approx(1.0) and s.step(2, 9.0) == pytest.approx(1.0)  # still in warmup
    assert s.step_update(11) == pytest.approx(1.0)  # warmup over: validation now counts
    assert s.step(3, 5.0) == pytest.approx(1.0) and s.step(4, 5.0) == pytest.approx(0.5)
    state = s.state_dict()
    assert state == {"best": 5.0, "last_epoch": 4}
    fresh, _ = scheduler(lr=1.0)
    fresh.load_state_dict(state)
    assert fresh.plateau.best == 5.0
    s0, opt0 = scheduler(lr=2.0, warmup_updates=4)  # --warmup-init-lr defaults to 0 with a warmup
    assert opt0.param_groups[0]["lr"] == 0.0 and s0.step_update(2) == pytest.approx(1.0)
    with pytest.raises(UserError, match="--lr-shrink"):
        scheduler(lr=1.0, lr_shrink=1.5)
