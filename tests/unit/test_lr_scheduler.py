"""LR schedulers: fairseq's values at chosen update counts (hand-computed), epochs, state, bad flags."""

import argparse
import math

import pytest
import torch

from toolkit.core.errors import UserError
from toolkit.optim.lr_scheduler import build_lr_scheduler


def optimizer(lr=1.0):
    p1, p2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    return torch.optim.SGD([{"params": [p1]}, {"params": [p2]}], lr=lr)


def sched(name, **kw):
    opt = optimizer()
    return build_lr_scheduler(dict(lr_scheduler=name, **kw), opt), opt


def lrs_of(opt):
    return [g["lr"] for g in opt.param_groups]


def check(s, opt, expected):
    for n, want in expected.items():
        got = s.step_update(n)
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), n
        assert lrs_of(opt) == [pytest.approx(want, rel=1e-12, abs=1e-15)] * 2  # every param group
        assert s.get_lr() == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_inverse_sqrt():
    s, opt = sched("inverse_sqrt", lr=5e-4, warmup_updates=4000)
    assert lrs_of(opt) == [0.0, 0.0]  # starts at warmup_init_lr (0 by default)
    check(s, opt, {0: 0.0, 1000: 1.25e-4, 3999: 5e-4 * 3999 / 4000, 4000: 5e-4, 16000: 2.5e-4, 64000: 1.25e-4})


def test_inverse_sqrt_warmup_init_lr_and_default_warmup():
    s, opt = sched("inverse_sqrt", lr=5e-4, warmup_init_lr=1e-7)
    assert s.warmup_updates == 4000  # fairseq's default
    check(s, opt, {0: 1e-7, 2000: 1e-7 + 2000 * (5e-4 - 1e-7) / 4000, 9000: 5e-4 * math.sqrt(4000 / 9000)})


def test_polynomial_decay():
    s, opt = sched("polynomial_decay", lr=1e-3, warmup_updates=100, total_num_update=1100, end_learning_rate=1e-5)
    assert lrs_of(opt) == [pytest.approx(1e-5)] * 2  # lr / warmup_updates before the first update
    check(
        s,
        opt,
        {0: 0.0, 50: 5e-4, 100: 1e-3, 600: 0.99e-3 * 0.5 + 1e-5, 1099: 0.99e-3 / 1000 + 1e-5, 1100: 1e-5, 5000: 1e-5},
    )


def test_polynomial_decay_power_and_max_update_default():
    s, opt = sched("polynomial_decay", lr=1e-3, warmup_updates=100, max_update=1100, end_learning_rate=1e-5, power=2.0)
    assert s.total_num_update == 1100
    check(s, opt, {600: 0.99e-3 * 0.25 + 1e-5, 850: 0.99e-3 * 0.0625 + 1e-5})


def test_polynomial_decay_force_anneal_takes_current_lr():
    s, opt = sched("polynomial_decay", lr=1e-3, total_num_update=1000, force_anneal=2)
    assert s.step_begin_epoch(1) == pytest.approx(1e-3)
    s.step_update(500)
    assert s.step_begin_epoch(2) == pytest.approx(5e-4)  # fairseq: the current lr becomes the base
    assert s.step_update(750) == pytest.approx(5e-4 * 0.25)


def test_cosine():
    s, opt = sched("cosine", lr=1e-3, min_lr=1e-5, warmup_updates=100, warmup_init_lr=1e-7, max_update=1100)
    assert s.period == 1000
    assert lrs_of(opt) == [1e-7, 1e-7]
    c = 0.5 * (1e-3 - 1e-5)
    check(
        s,
        opt,
        {
            0: 1e-7,
            50: 1e-7 + 50 * (1e-3 - 1e-7) / 100,
            100: 1e-3,
            350: 1e-5 + c * (1 + math.cos(math.pi / 4)),
            600: 1e-5 + c,
            1099: 1e-5 + c * (1 + math.cos(math.pi * 999 / 1000)),
            # a new period: peak and minimum shrunk by --lr-shrink (0.1)
            1100: 1e-4,
            1600: 1e-6 + 0.5 * (1e-4 - 1e-6),
        },
    )


def test_cosine_t_mult_and_period():
    s, opt = sched("cosine", lr=1e-3, lr_period_updates=100, t_mult=2.0, lr_shrink=0.5)
    assert lrs_of(opt) == [0.0, 0.0]  # warmup_init_lr defaults to --min-lr (0)
    check(
        s,
        opt,
        {0: 1e-3, 50: 0.5e-3, 100: 0.5e-3, 200: 0.25e-3, 300: 0.25e-3, 500: 0.125e-3, 700: 0.125e-3, 1500: 0.0625e-3},
    )


def test_fixed_warmup_and_anneal():
    s, opt = sched("fixed", lr=0.1, warmup_updates=4, force_anneal=3, lr_shrink=0.5)
    assert s.step_begin_epoch(1) == pytest.approx(0.025)
    check(s, opt, {0: 0.025, 1: 0.05, 3: 0.1, 10: 0.1})
    assert s.step_begin_epoch(2) == pytest.approx(0.1)
    assert s.step_begin_epoch(3) == pytest.approx(0.05)  # lr * lr_shrink ** (epoch + 1 - force_anneal)
    assert s.step_update(20) == pytest.approx(0.05)
    assert s.step_begin_epoch(4) == pytest.approx(0.025)
    assert s.step(4, val_loss=3.0) == pytest.approx(0.025)
    s.step(5, val_loss=2.0)
    s.step(6, val_loss=2.5)
    state = s.state_dict()
    assert state == {"lr": 0.025, "best": 2.0}
    s2, _ = sched("fixed", lr=0.1)
    s2.load_state_dict(state)
    assert (s2.lr, s2.best) == (0.025, 2.0)
    assert s2.step_update(0) == pytest.approx(0.025)


def test_fixed_without_warmup_is_constant():
    s, opt = sched("fixed", lr=0.3)
    assert lrs_of(opt) == [0.3, 0.3]
    check(s, opt, {0: 0.3, 100: 0.3})
    assert s.step_begin_epoch(50) == pytest.approx(0.3)


def test_state_dict_round_trip_keeps_best():
    s, _ = sched("inverse_sqrt", lr=1e-3, warmup_updates=10)
    s.step(1, val_loss=4.0)
    s.step(2, val_loss=5.0)
    s2, _ = sched("inverse_sqrt", lr=1e-3, warmup_updates=10)
    s2.load_state_dict(s.state_dict())
    assert s2.best == 4.0


def test_namespace_args_and_default_scheduler():
    opt = optimizer()
    s = build_lr_scheduler(argparse.Namespace(lr=0.5, warmup_updates=0, force_anneal=None, lr_shrink=0.1), opt)
    assert type(s).__name__ == "FixedLRSchedule" and lrs_of(opt) == [0.5, 0.5]


@pytest.mark.parametrize(
    "kw,flag",
    [
        (dict(lr_scheduler="polynomial_decay", lr=1e-3), "--total-num-update"),
        (dict(lr_scheduler="cosine", lr=1e-3), "--lr-period-updates"),
        (dict(lr_scheduler="cosine", lr=1e-3, min_lr=1e-3, max_update=100), "--min-lr"),
        (dict(lr_scheduler="cosine", lr=1e-3, warmup_updates=100, max_update=100), "--warmup-updates"),
        (dict(lr_scheduler="inverse_sqrt", lr=1e-3, warmup_updates=0), "--warmup-updates"),
        (dict(lr_scheduler="fixed", lr=1e-3, warmup_updates=-1), "--warmup-updates"),
    ],
)
def test_bad_combinations(kw, flag):
    with pytest.raises(UserError, match=flag):
        build_lr_scheduler(kw, optimizer())


def test_flags_are_generated_and_shared():
    from toolkit.config import OptimizationConfig
    from toolkit.optim.lr_scheduler.cosine import CosineLRScheduleConfig
    from toolkit.config.options import add_dataclass_options

    parser = argparse.ArgumentParser()
    add_dataclass_options(parser, OptimizationConfig)
    add_dataclass_options(parser, CosineLRScheduleConfig)
    args = parser.parse_args(
        [
            "--lr",
            "0.001",
            "--max-update",
            "1100",
            "--warmup-updates",
            "100",
            "--min-lr",
            "1e-5",
            "--t-mult",
            "2",
            "--lr-shrink",
            "0.5",
        ]
    )
    s = build_lr_scheduler(dict(vars(args), lr_scheduler="cosine"), optimizer())
    assert (s.max_lr, s.period, s.min_lr, s.t_mult, s.lr_shrink) == (1e-3, 1000, 1e-5, 2.0, 0.5)
