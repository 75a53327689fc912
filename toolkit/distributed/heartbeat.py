"""Heartbeats: a rank that dies or freezes stops the whole run, named, within ``--heartbeat-timeout``.

Each rank runs a daemon thread that every ``interval`` seconds writes one key of the
rendezvous store (the TCPStore at ``MASTER_ADDR:MASTER_PORT``: torchrun's agent store,
or rank 0's under our own spawner)::

    toolkit/hb/<run>/<rank> = {"n": beats, "step": micro-batches, "state": "running"|"done"|"failed",
                               "where": "trainer.py:98 train_step", "host": ..., "pid": ...}

Rank 0 watches every rank; the other ranks watch rank 0 (O(world size) store traffic).
A watched rank whose beat counter has not moved for ``--heartbeat-timeout`` seconds
(minus two intervals) is dead, frozen (SIGSTOP, swapping, a lost node) or cut off: the
watcher writes ``abort`` with a message naming it, prints the message and exits; every
other rank sees ``abort`` within one interval and exits too. A rank that fails with an
exception publishes ``failed`` and its error, which stops the others at once. Only
counters are compared, each against the watcher's own clock, so nodes' clocks need not agree.

Hangs inside a collective are also bounded by the process group's timeout
(:func:`toolkit.distributed.utils.pg_timeout`); when that fires, :func:`describe_ranks`
says where each rank was (micro-batches done and the innermost toolkit frame), which
points at the straggler.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Dict, List, Optional

import torch.distributed as dist

from toolkit.distributed import parent_watch
from toolkit.distributed.parallel_dims import ParallelShape

logger = logging.getLogger(__name__)

EXIT_CODE = 1
_TOOLKIT_DIRS = (os.sep + "toolkit" + os.sep, os.sep + "toolkit_cli" + os.sep)


def _main_thread_location() -> str:
    """``file.py:line function`` of the innermost toolkit frame of the main thread (else the innermost)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    innermost = None
    while frame is not None:
        code = frame.f_code
        here = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}"
        innermost = innermost or here
        if any(d in code.co_filename for d in _TOOLKIT_DIRS) and "heartbeat" not in code.co_filename:
            return here
        frame = frame.f_back
    return innermost or "?"


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def interval_for(timeout: float) -> float:
    """Seconds between beats for a given --heartbeat-timeout (a tenth of it, within [0.2, 5])."""
    return min(max(float(timeout) / 10.0, 0.2), 5.0)


class Heartbeat:
    def __init__(
        self,
        store,
        rank: int,
        world_size: int,
        timeout: float,
        prefix: str = "toolkit/hb/",
        interval: Optional[float] = None,
        store_desc: str = "the rendezvous store",
        layout: Optional[ParallelShape] = None,
    ):
        self.store = store
        self.layout = layout  # names a lost rank's place (its TP/data-parallel peers are the ones stuck)
        self.rank, self.world_size = rank, world_size
        self.timeout = float(timeout)
        self.interval = interval or interval_for(self.timeout)
        # Detection (stale_after + one interval) plus the launcher's grace (two intervals) fits in the timeout.
        self.stale_after = max(self.timeout - 3 * self.interval, self.interval)
        self.prefix = prefix
        self.store_desc = store_desc
        self.beats = 0
        self.steps = 0
        self.state = "running"
        self.error = ""
        self.watched: List[int] = [r for r in (range(world_size) if rank == 0 else [0]) if r != rank]
        self._seen: Dict[int, tuple] = {}  # rank -> (beat counter, local time it last changed)
        self._started = time.monotonic()
        self._store_down_since: Optional[float] = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one store operation at a time from this process
        self._thread = threading.Thread(target=self._run, name="toolkit-heartbeat", daemon=True)

    # --- keys ---------------------------------------------------------------------
    def _key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    @property
    def _abort_key(self) -> str:
        return f"{self.prefix}abort"

    def _payload(self) -> str:
        return json.dumps(
            {
                "n": self.beats,
                "step": self.steps,
                "state": self.state,
                "error": self.error,
                "where": _main_thread_location() if self.state == "running" else "",
                "host": socket.gethostname(),
                "pid": os.getpid(),
            }
        )

    # --- life cycle ---------------------------------------------------------------
    def start(self) -> None:
        self._publish()
        self._thread.start()
        logger.info(
            f"heartbeat: every {self.interval:.1f} s; a rank silent for {self.timeout:.0f} s "
            f"(--heartbeat-timeout) stops the run"
        )

    def progress(self) -> None:
        self.steps += 1

    def stop(self, ok: bool = True, error: Optional[BaseException] = None) -> None:
        """Stop beating; tell the others we are done (or failed, and why)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.interval + 1)
        self.state = "done" if ok else "failed"
        if error is not None:
            self.error = _one_line(error)
        try:
            self._publish()
            if not ok:
                self._set_abort(
                    f"rank {self.rank} ({socket.gethostname()}, pid {os.getpid()}) failed: "
                    f"{self.error or 'exited with an error'}"
                )
        except Exception:
            pass  # the store may be gone already (its host failed first)

    # --- the thread -----------------------------------------------------------------
    def _publish(self) -> None:
        with self._lock:
            self.store.set(self._key(self.rank), self._payload())

    def _set_abort(self, message: str) -> None:
        with self._lock:
            # The first failure's message wins; later ones are usually its consequences.
            self.store.compare_set(self._abort_key, "", message)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._tick()
                self._store_down_since = None
            except Exception as e:  # the store's host (rank 0 or the torchrun agent) is gone or unreachable
                if self._stop.is_set():
                    return
                parent_watch.exit_if_orphaned()  # the store went down with our launcher: say that
                now = time.monotonic()
                self._store_down_since = self._store_down_since or now
                if now - self._store_down_since > self.stale_after:
                    host = (
                        "the torchrun agent"
                        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
                        else "the toolkit-train launcher"
                        if os.environ.get("TOOLKIT_LAUNCHER_STORE") == "1"
                        else "rank 0"
                    )
                    self._die(
                        f"lost contact with {self.store_desc} (hosted by {host}) for "
                        f"{now - self._store_down_since:.0f} s: {host} died or its node is unreachable "
                        f"({_one_line(e)})",
                        announce=False,
                    )

    def _tick(self) -> None:
        self.beats += 1
        self._publish()
        with self._lock:
            aborted = self.store.check([self._abort_key])
            message = self.store.get(self._abort_key).decode() if aborted else ""
        if message:
            self._die(f"stopping rank {self.rank}: {message}", announce=False)
        now = time.monotonic()
        for r in self.watched:
            info = self._read(r)
            if info is None:  # not started yet
                if now - self._started > self.stale_after:
                    self._die(
                        f"rank {r} never sent a heartbeat in {now - self._started:.0f} s "
                        f"(--heartbeat-timeout {self.timeout:.0f}); it did not start or is stuck before "
                        f"joining"
                    )
                continue
            if info.get("state") == "done":
                continue
            if info.get("state") == "failed":
                self._die(
                    f"rank {r} ({info.get('host')}, pid {info.get('pid')}) failed: "
                    f"{info.get('error') or 'exited with an error'}{self._place(r)}"
                )
            seen = self._seen.get(r)
            if seen is None or seen[0] != info.get("n"):
                self._seen[r] = (info.get("n"), now, info)
                continue
            silent = now - seen[1]
            if silent > self.stale_after:
                self._die(
                    f"rank {r} ({info.get('host')}, pid {info.get('pid')}) sent no heartbeat for "
                    f"{silent:.0f} s (--heartbeat-timeout {self.timeout:.0f}): it died, froze or lost its "
                    f"network; last seen after {info.get('step')} micro-batches at {info.get('where')}"
                    f"{self._place(r)}"
                )

    def _place(self, rank: int) -> str:
        place = self.layout.placement(rank) if self.layout is not None else ""
        return f"; its place in the parallel layout: {place}" if place else ""

    def _read(self, rank: int) -> Optional[dict]:
        key = self._key(rank)
        with self._lock:
            if rank not in self._seen and not self.store.check([key]):
                return None
            raw = self.store.get(key)
        return json.loads(raw.decode() if isinstance(raw, bytes) else raw)

    def _die(self, message: str, announce: bool = True) -> None:
        """Tell every rank (``abort``), say why, and exit without waiting for the stuck main thread."""
        if announce:
            try:
                self._set_abort(message)
            except Exception:
                pass
        # No locks here (the main thread may hold the logging or stdout locks while stuck): write and go.
        try:
            os.write(2, f"toolkit-train: error: {message}\n".encode())
        finally:
            os._exit(EXIT_CODE)

    def describe(self) -> str:
        """Where every rank was at its last beat (for an error message)."""
        parts = []
        for r in range(self.world_size):
            try:
                info = self._read(r) if r != self.rank else json.loads(self._payload())
            except Exception:
                info = None
            if info is None:
                parts.append(f"rank {r}: no heartbeat")
            else:
                parts.append(f"rank {r}: {info.get('state')}, {info.get('step')} micro-batches, at {info.get('where')}")
        return "; ".join(parts)


_HEARTBEAT: Optional[Heartbeat] = None


def _connect_store(timeout: float):
    """A client of the rendezvous store (its own connection, so it never queues behind the process group's)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        store = dist.TCPStore(
            addr,
            int(port),
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=max(min(timeout, 60.0), 5.0)),
        )
        return store, f"the rendezvous store at {addr}:{port}"
    return dist.distributed_c10d._get_default_store(), "the process group's store"


def key_prefix() -> str:
    """Keys of this run (and of this torchrun restart: the agent's store outlives restarts)."""
    return (
        f"toolkit/hb/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/"
        f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    )


def abort_key() -> str:
    return key_prefix() + "abort"


def start(rank: int, world_size: int, timeout: float, layout: Optional[ParallelShape] = None) -> Optional[Heartbeat]:
    """Start this rank's heartbeat (no-op for one rank or a non-positive timeout)."""
    global _HEARTBEAT
    if world_size <= 1 or timeout <= 0:
        return None
    stop()
    store, desc = _connect_store(timeout)
    _HEARTBEAT = Heartbeat(store, rank, world_size, timeout, prefix=key_prefix(), store_desc=desc, layout=layout)
    _HEARTBEAT.start()
    _install_exit_hooks()
    return _HEARTBEAT


_uncaught: List[BaseException] = []
_hooks_installed = False


def _install_exit_hooks() -> None:
    """For callers that never call :func:`stop`: say "done" (or "failed") when the interpreter exits."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        _uncaught.append(value)
        previous(kind, value, tb)

    sys.excepthook = excepthook
    atexit.register(lambda: stop(ok=not _uncaught, error=_uncaught[0] if _uncaught else None))


def progress() -> None:
    """Count one micro-batch of this rank (shown in failure messages)."""
    if _HEARTBEAT is not None:
        _HEARTBEAT.progress()


def stop(ok: bool = True, error: Optional[BaseException] = None) -> None:
    global _HEARTBEAT
    if _HEARTBEAT is not None:
        _HEARTBEAT.stop(ok=ok, error=error)
        _HEARTBEAT = None


def describe_ranks() -> str:
    return _HEARTBEAT.describe() if _HEARTBEAT is not None else ""
