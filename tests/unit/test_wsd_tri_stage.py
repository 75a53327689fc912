"""``--lr-scheduler tri_stage`` against fairseq's formula written out here, and ``--lr-scheduler wsd``: its shapes,
its resume mid-decay and from a stable-phase checkpoint, its bad flags."""

import logging
import math

import pytest
import torch

from toolkit.core.errors import UserError
from toolkit.optim.lr_scheduler import build_lr_scheduler


def optimizer():
    p1, p2 = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    return torch.optim.SGD([{"params": [p1]}, {"params": [p2]}], lr=1.0)


def sched(name, **kw):
    opt = optimizer()
    return build_lr_scheduler(dict(lr_scheduler=name, **kw), opt), opt


def fairseq_tri_stage(n, lr, warmup, hold, decay, init_scale, final_scale):
    """fairseq/optim/lr_scheduler/tri_stage_lr_scheduler.py's step_update, as it computes it."""
    init_lr, final_lr = init_scale * lr, final_scale * lr
    rate = (lr - init_lr) / warmup if warmup != 0 else 0
    factor = -math.log(final_scale) / decay
    if n < warmup:
        return init_lr + rate * n
    if n < warmup + hold:
        return lr
    if n <= warmup + hold + decay:
        return lr * math.exp(-factor * (n - warmup - hold))
    return final_lr


@pytest.mark.parametrize(
    "flags, stages",
    [
        (dict(warmup_steps=40, hold_steps=100, decay_steps=60), (40, 100, 60)),
        (dict(warmup_steps=0, hold_steps=0, decay_steps=7, init_lr_scale=0.5, final_lr_scale=0.05), (0, 0, 7)),
        (dict(phase_ratio=(0.1, 0.4, 0.5), max_update=333), (33, 133, 166)),  # int() truncation, as fairseq
        (dict(phase_ratio=(0.25, 0.0, 0.75), max_update=100, init_lr_scale=0.0, final_lr_scale=0.2), (25, 0, 75)),
    ],
)
def test_tri_stage_matches_fairseq_at_every_update(flags, stages):
    s, opt = sched("tri_stage", lr=3e-3, **flags)
    init_scale, final_scale = flags.get("init_lr_scale", 0.01), flags.get("final_lr_scale", 0.01)
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(init_scale * 3e-3)] * 2
    for n in range(0, sum(stages) + 20):
        want = fairseq_tri_stage(n, 3e-3, *stages, init_scale, final_scale)
        assert s.step_update(n) == pytest.approx(want, rel=1e-12, abs=1e-18), n
        assert [g["lr"] for g in opt.param_groups] == [pytest.approx(want, rel=1e-12, abs=1e-18)] * 2
    assert s.step(1, 2.0) == pytest.approx(final_scale * 3e-3) and s.best == 2.0  # the epoch hook changes nothing


@pytest.mark.parametrize(
    "flags, hint",
    [
        (dict(warmup_steps=5, hold_steps=5), "--decay-steps"),
        (dict(phase_ratio=(0.5, 0.6, 0.1), max_update=100), "--phase-ratio"),
        (dict(phase_ratio=(0.5, 0.5), max_update=100), "--phase-ratio"),
        (dict(phase_ratio=(0.1, 0.4, 0.5)), "--max-update"),
        (dict(decay_steps=5, final_lr_scale=0.0), "--final-lr-scale"),
    ],
)
def test_tri_stage_bad_flags(flags, hint):
    with pytest.raises(UserError, match=hint):
        sched("tri_stage", lr=1e-3, **flags)


@pytest.mark.parametrize(
    "shape, share_left",
    [
        ("linear", lambda t: 1 - t),
        ("cosine", lambda t: 0.5 * (1 + math.cos(math.pi * t))),
        ("1-sqrt", lambda t: 1 - math.sqrt(t)),
    ],
)
def test_wsd_warmup_stable_decay(shape, share_left):
    # 100 updates, last 20% decaying: the decay runs over updates 80..100
    s, opt = sched(
        "wsd", lr=1e-3, min_lr=1e-4, warmup_updates=10, max_update=100, decay_fraction=0.2, decay_shape=shape
    )
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    want = {0: 0.0, 4: 4e-4, 10: 1e-3, 50: 1e-3, 79: 1e-3, 80: 1e-3, 100: 1e-4, 120: 1e-4}
    want.update({n: 1e-4 + 9e-4 * share_left((n - 80) / 20) for n in (85, 90, 97)})
    for n, lr in want.items():
        assert s.step_update(n) == pytest.approx(lr, rel=1e-12, abs=1e-18), n
        assert [g["lr"] for g in opt.param_groups] == [pytest.approx(lr, rel=1e-12, abs=1e-18)] * 2
    assert s.step_update(90) < s.step_update(89)


def test_wsd_total_num_update_and_explicit_decay_start():
    s, _ = sched("wsd", lr=1.0, max_update=50, total_num_update=200, decay_fraction=0.5, decay_shape="linear")
    assert (s.decay_start, s.decay_end) == (100, 200) and s.step_update(150) == pytest.approx(0.5)
    s, _ = sched("wsd", lr=1.0, max_update=200, wsd_decay_start=190, decay_shape="linear")
    assert s.step_update(189) == 1.0 and s.step_update(195) == pytest.approx(0.5)


def run(s, updates):
    return [s.step_update(n) for n in updates]


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_wsd_resume_mid_decay_gives_the_uninterrupted_rates(shape):
    flags = dict(lr=2e-3, min_lr=2e-5, warmup_updates=3, max_update=40, decay_fraction=0.5, decay_shape=shape)
    whole, _ = sched("wsd", **flags)
    want = run(whole, range(0, 45))
    first, _ = sched("wsd", **flags)
    head = run(first, range(0, 27))  # stops at update 26, inside the decay (20..40)
    state = first.state_dict()
    second, opt = sched("wsd", **flags)
    second.load_state_dict(state)
    second.step_update(26)  # what the trainer does after loading a checkpoint
    assert opt.param_groups[0]["lr"] == want[26]
    assert head + run(second, range(27, 45)) == want  # bit-identical


def _warnings_while(fn) -> str:
    """The wsd module's warnings while ``fn`` runs, read from a handler on its own logger (an earlier test's
    setup_logging or Hydra may stop propagation or disable it)."""
    from toolkit.optim.lr_scheduler import wsd

    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    # Hydra's dictConfig (an earlier test) disables existing loggers; a level or logging.disable may hide it too
    saved = wsd.logger.disabled, wsd.logger.level, logging.root.manager.disable
    wsd.logger.disabled, _ = False, wsd.logger.setLevel(logging.WARNING)
    logging.disable(logging.NOTSET)
    wsd.logger.addHandler(handler)
    try:
        fn()
    finally:
        wsd.logger.removeHandler(handler)
        wsd.logger.disabled, _ = saved[0], wsd.logger.setLevel(saved[1])
        logging.disable(saved[2])
    return "\n".join(records)


def test_wsd_decay_from_a_stable_phase_checkpoint():
    stable, _ = sched("wsd", lr=1e-3, max_update=1000, decay_fraction=0.0)
    assert set(run(stable, range(0, 600))) == {1e-3} and stable.step_update(1000) == 1e-3  # no decay at all
    state = stable.state_dict()
    decay, _ = sched("wsd", lr=1e-3, max_update=700, wsd_decay_start=600, decay_shape="linear")
    assert not _warnings_while(
        lambda: decay.load_state_dict(state)
    )  # a stable checkpoint resumed with a decay: the intended use, nothing to warn
    assert decay.step_update(599) == 1e-3 and decay.step_update(600) == 1e-3
    assert decay.step_update(650) == pytest.approx(5e-4)
    assert decay.step_update(700) == 0.0


def test_wsd_warns_when_a_decaying_checkpoint_gets_another_window():
    first, _ = sched("wsd", lr=1.0, max_update=100, decay_fraction=0.5, decay_shape="linear")
    run(first, range(0, 76))
    other, _ = sched("wsd", lr=1.0, max_update=200, decay_fraction=0.5, decay_shape="linear")
    text = _warnings_while(lambda: other.load_state_dict(first.state_dict()))
    assert "jumps from 0.5 to 1" in text and "50..100" in text


@pytest.mark.parametrize(
    "flags, hint",
    [
        (dict(), "--max-update"),
        (dict(max_update=100, decay_fraction=1.5), "--decay-fraction"),
        (dict(max_update=100, wsd_decay_start=101), "--wsd-decay-start"),
        (dict(max_update=100, warmup_updates=50, wsd_decay_start=40), "--wsd-decay-start"),
        (dict(max_update=100, min_lr=2e-3), "--min-lr"),
        (dict(max_update=100, warmup_updates=-1), "--warmup-updates"),
    ],
)
def test_wsd_bad_flags(flags, hint):
    with pytest.raises(UserError, match=hint):
        sched("wsd", lr=1e-3, **flags)
