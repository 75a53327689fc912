"""Ctrl-C and a killed data loader worker end a training run with one line, wherever torch's SIGCHLD handler
raises its error: the integration test kills a real worker (tests/integration/test_bad_inputs.py); these
tests place the handler's error at the instants a real kill only reaches by chance."""

from __future__ import annotations

import signal
import sys
from types import SimpleNamespace

import pytest

from toolkit.core.errors import Interrupted, UserError
from toolkit.train import train_loop

KILLED = "DataLoader worker (pid 4242) is killed by signal: Killed. "


def _run_state(num_workers: int = 2, update: int = 7):
    cfg = SimpleNamespace(
        dataset=SimpleNamespace(num_workers=num_workers), checkpoint=SimpleNamespace(use_sharded_state=False)
    )
    state = SimpleNamespace(trainer=SimpleNamespace(num_updates=update), saved_update=None)
    return cfg, state


@pytest.fixture
def restored_process_hooks(monkeypatch):
    """The teardown silences sys.excepthook and SIGCHLD for the process's last moments: put both back."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    previous = signal.getsignal(signal.SIGCHLD)
    yield
    signal.signal(signal.SIGCHLD, previous)


def _raise(error: BaseException):
    def run():
        raise error

    return run


def test_the_handlers_error_is_one_line(restored_process_hooks):
    cfg, state = _run_state()
    with pytest.raises(UserError) as caught:
        train_loop.reporting_interruptions(_raise(RuntimeError(KILLED)), cfg, state)
    assert str(caught.value) == (
        "--num-workers 2: a data loader worker died at update 7 (DataLoader worker "
        "(pid 4242) is killed by signal: Killed); no checkpoint_last.pt saved yet: "
        "run again to resume"
    )
    assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL  # the handler cannot raise a second time


def test_the_handlers_error_landing_while_a_broken_read_is_reported_is_still_one_line(
    restored_process_hooks, monkeypatch
):
    """What CI saw: the read of the worker's batch failed (ConnectionResetError in rebuild_storage_fd) and the
    handler's RuntimeError arrived inside the code reporting that first error."""
    cfg, state = _run_state()
    calls = []
    real_teardown = train_loop._quiet_worker_teardown

    def handler_lands_first_time():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(KILLED)
        real_teardown()

    monkeypatch.setattr(train_loop, "_quiet_worker_teardown", handler_lands_first_time)
    with pytest.raises(UserError, match=r"a data loader worker died at update 7 \(DataLoader worker \(pid 4242\)"):
        train_loop.reporting_interruptions(_raise(ConnectionResetError(104, "Connection reset by peer")), cfg, state)
    assert len(calls) == 2


def test_a_broken_read_alone_is_one_line(restored_process_hooks):
    cfg, state = _run_state()
    state.saved_update = 4
    with pytest.raises(UserError, match=r"died at update 7 \(its connection broke\); checkpoint_last.pt is update 4"):
        train_loop.reporting_interruptions(_raise(EOFError()), cfg, state)


def test_ctrl_c_says_where_the_run_stopped():
    cfg, state = _run_state()
    with pytest.raises(Interrupted, match="interrupted at update 7; no checkpoint_last.pt saved yet"):
        train_loop.reporting_interruptions(_raise(KeyboardInterrupt()), cfg, state)


@pytest.mark.parametrize(
    "error", [RuntimeError("shape mismatch"), ValueError("bad"), ConnectionResetError(104, "reset")]
)
def test_other_errors_propagate_unchanged(error):
    cfg, state = _run_state(num_workers=0)  # no workers: a broken connection is not theirs
    with pytest.raises(type(error)) as caught:
        train_loop.reporting_interruptions(_raise(error), cfg, state)
    assert caught.value is error
