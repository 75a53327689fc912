"""A worker never outlives its launcher: the orphan check, the parent-death signal armed from a spawned worker's
first import, SIGINT taken back by a launcher that inherited it ignored (the real processes:
tests/integration/test_orphans.py)."""

from __future__ import annotations

import os
import sys

import pytest

from toolkit.distributed import parent_watch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_orphan_check_in_this_process():
    assert parent_watch.set_parent_death_signal(0)  # 0 clears it: the call itself works here
    watch = parent_watch.ParentWatch(os.getppid(), "x", "y")
    assert not watch.orphaned()
    assert parent_watch.ParentWatch(os.getppid() + 1, "x", "y").orphaned()


# A child reading its own parent-death signal (prctl PR_GET_PDEATHSIG) after the package every command imports first
READ_PDEATHSIG = """
import ctypes, os, sys
import toolkit_cli
signum = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(signum), 0, 0, 0)
print(signum.value, os.environ.get("TOOLKIT_LAUNCHER_PID"))
"""


def _child(launcher_pid: int):
    import subprocess

    from tests.helpers.cli import subprocess_env

    env = {**subprocess_env(), parent_watch.LAUNCHER_ENV: str(launcher_pid)}
    return subprocess.run([sys.executable, "-c", READ_PDEATHSIG], env=env, capture_output=True, text=True, timeout=60)


def test_a_spawned_worker_dies_with_its_launcher_from_its_first_import():
    """The launcher's pid in the environment, and the launcher our parent: SIGKILL armed for its death, and the
    variable gone (a process the worker starts is not the launcher's)."""
    run = _child(os.getpid())
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["9", "None"]


def test_a_worker_whose_launcher_is_gone_already_stops_at_its_first_import():
    """Re-parented before it got there (the launcher was killed while the worker's interpreter started)."""
    run = _child(os.getpid() + 1_000_000)  # not our child's parent: as if ours had died
    assert run.returncode == parent_watch.EXIT_CODE and run.stdout == "", run.stderr[-2000:]


def test_the_launcher_takes_sigint_back_from_an_inherited_ignore():
    import signal

    from toolkit.distributed import launch

    before = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's background job starts
        launch.stop_on_sigint()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

        def own(*_):  # a handler someone installed is theirs: kept
            pass

        signal.signal(signal.SIGINT, own)
        launch.stop_on_sigint()
        assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, before)
