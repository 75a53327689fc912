"""Workers never outlive their launcher.

A worker started by ``toolkit-train --distributed-world-size N`` or by torchrun's agent
is useless once that parent is gone (``kill -9``, OOM killer, a lost session): nobody
collects its exit status, the rendezvous store may be gone with it, and it would keep
training and writing checkpoints until the heartbeat times out. Two mechanisms, either
sufficient:

- Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``): the kernel sends us
  ``SIGUSR2`` the moment the parent dies; its handler stops the process.
- a watchdog thread that sees ``os.getppid()`` change (we were re-parented): it also
  works when the main thread sits in a long C++ call (a collective) where Python signal
  handlers wait, and on systems without ``prctl``.

Either way the worker prints one line saying why and leaves with ``os._exit``: no
process-group teardown, whose C++ layers would print pages of stack frames about the
peers that vanished at the same moment.

Both are armed once the worker runs our code, seconds after it starts (a spawned worker imports torch and the
toolkit first). A launcher killed meanwhile would leave its workers importing for 3-12 s, then stopping: so a
worker our launcher spawned (its pid in :data:`LAUNCHER_ENV`) asks the kernel for ``SIGKILL`` on the launcher's
death as the first thing it does (:func:`stop_with_launcher`, from ``toolkit_cli/__init__.py``, which the
spawned interpreter imports before torch); nothing has started yet that a message would explain.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from typing import Optional

PR_SET_PDEATHSIG = 1
LAUNCHER_ENV = "TOOLKIT_LAUNCHER_PID"  # set by toolkit.distributed.launch while it spawns its workers
EXIT_CODE = 1
POLL_SECONDS = 0.5
_SIGNAL = signal.SIGUSR2

_watch: Optional[ParentWatch] = None


def set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel to send ``signum`` when our parent exits (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def stop_with_launcher() -> None:
    """In a worker our launcher spawned (the launcher's pid in :data:`LAUNCHER_ENV`, which only its own children
    see: read once, then removed): die with the launcher from here on (``SIGKILL`` from the kernel), at once if
    it is gone already (we were re-parented before getting here)."""
    launcher = os.environ.pop(LAUNCHER_ENV, "")
    if not launcher.isdigit():
        return
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != int(launcher):
        os._exit(EXIT_CODE)


class ParentWatch:
    def __init__(self, parent_pid: int, parent_desc: str, who: str):
        self.parent_pid, self.parent_desc, self.who = parent_pid, parent_desc, who
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="toolkit-parent-watch", daemon=True)

    def orphaned(self) -> bool:
        return os.getppid() != self.parent_pid

    def die(self) -> None:
        """One line, then leave at once (no locks taken: the main thread may hold logging's or stdout's)."""
        try:
            os.write(
                2,
                (
                    f"toolkit-train: error: {self.who}: {self.parent_desc} (pid {self.parent_pid}) died; "
                    f"stopping this worker\n"
                ).encode(),
            )
        finally:
            os._exit(EXIT_CODE)

    def start(self) -> None:
        if set_parent_death_signal(_SIGNAL) and threading.current_thread() is threading.main_thread():
            signal.signal(_SIGNAL, lambda _signum, _frame: self.die())
        if self.orphaned():  # the parent died before the signal was armed
            self.die()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            if self.orphaned():
                self.die()


def watch_parent(parent_pid: int, parent_desc: str, who: str) -> ParentWatch:
    """Stop this process (one line) as soon as ``parent_pid`` is no longer its parent."""
    global _watch
    if _watch is not None:
        _watch.stop()
    _watch = ParentWatch(parent_pid, parent_desc, who)
    _watch.start()
    return _watch


def exit_if_orphaned() -> None:
    """For error paths: a failure caused by the parent's death is reported as that, not as its symptoms."""
    if _watch is not None and _watch.orphaned():
        _watch.die()
