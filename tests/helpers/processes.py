"""The processes tests start: Ctrl-C (SIGINT) reaches them, and none outlives its test.

A shell starts a background job of a non-interactive shell (``bash -c 'pytest ... & wait'``, CI runners,
``nohup``) with SIGINT ignored, and an ignored signal stays ignored in every child: a test that
interrupts a training would wait for ever on a process that never hears it. ``start`` gives the
child SIGINT's default back (Python then raises KeyboardInterrupt in it, as under a terminal), and
remembers it: the ``kill_started_processes`` fixture (tests/conftest.py) kills whatever a test
started and left running, whichever way the test ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Callable, List, Tuple

_STARTED: List[subprocess.Popen] = []


def sigint_default() -> None:
    """``preexec_fn``: SIGINT as a terminal's foreground process has it (an inherited SIG_IGN undone)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def sigint_ignored() -> None:
    """``preexec_fn``: SIGINT ignored, as a background job of a non-interactive shell starts (what a test of that
    case starts; every other test gives its child the default, :func:`sigint_default`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start(cmd, ignore_sigint: bool = False, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kwargs)`` with SIGINT at its default (ignored with ``ignore_sigint``), killed at the
    end of the test if still running."""
    proc = subprocess.Popen(cmd, preexec_fn=sigint_ignored if ignore_sigint else sigint_default, **kwargs)
    _STARTED.append(proc)
    return proc


def interrupt(proc: subprocess.Popen, timeout: float = 120):
    """Ctrl-C ``proc`` and wait for it: its ``communicate()``; killed (and the test failed) if it ignores it."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"pid {proc.pid} did not stop within {timeout}s of SIGINT; killed") from None


def kill_started() -> List[int]:
    """Kill (SIGKILL) and reap every process ``start`` started that still runs; their PIDs."""
    killed = []
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            killed.append(proc.pid)
        try:
            proc.communicate(timeout=30)
        except (subprocess.TimeoutExpired, ValueError, OSError):
            pass
    return killed


def read_until(proc: subprocess.Popen, predicate: Callable[[str], bool], timeout: float) -> Tuple[List[str], float]:
    """Lines of ``proc``'s stdout until one satisfies ``predicate`` (returned with the time it was read); an
    AssertionError showing the last lines if the output ends or ``timeout`` seconds pass first."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if predicate(line):
            return lines, time.monotonic()
    raise AssertionError("expected output did not come:\n" + "".join(lines[-50:]))


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped by its new parent, counts as gone; Linux's /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill_survivors(pids: List[int], timeout: float) -> List[int]:
    """Wait up to ``timeout`` seconds for ``pids`` (processes ``start`` did not start itself: a launcher's
    workers) to end, then SIGKILL those still running; the ones that had to be killed (empty: all ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.2)
    survivors = [pid for pid in pids if alive(pid)]
    for pid in survivors:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return survivors
