"""Start the training processes: under torchrun, join; on one machine, spawn the workers ourselves.

``toolkit-train --distributed-world-size N ...`` (not under torchrun) makes this
process a small launcher, like torchrun's agent:

- it hosts the rendezvous TCPStore (on a free port, or ``--distributed-port``) so the
  store outlives any worker, and spawns N workers (``torch.multiprocessing``, start
  method ``spawn``) with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/
  ``MASTER_ADDR``/``MASTER_PORT`` set;
- it watches them: when one exits with an error or is killed, it writes the reason to
  the store's ``abort`` key (the other ranks' heartbeat threads stop them at once),
  gives them a few seconds, kills what is left, names the rank that failed, and
  exits non-zero. A rank that freezes is caught by the heartbeat (see
  :mod:`toolkit.distributed.heartbeat`) within ``--heartbeat-timeout``.

Under torchrun every process simply runs as one rank; torchrun's agent watches them.

As in fairseq, a run started without ``--distributed-world-size`` on a machine with several
visible GPUs (and without ``--cpu``) uses all of them (:func:`default_world_size`, applied
by the resolver), and ``srun ... --distributed-port P`` reads the job's layout from Slurm
(:mod:`toolkit.distributed.slurm`): each task is one rank, or spawns its node's workers.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import logging
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from toolkit.core import folder_lock
from toolkit.config import TrainConfig
from toolkit.distributed import heartbeat, parent_watch, slurm
from toolkit.distributed.utils import shutdown, under_launcher
from toolkit.core.errors import Interrupted, UserError

logger = logging.getLogger(__name__)

PROG = "toolkit-train"
HOSTED_STORE_ENV = "TOOLKIT_LAUNCHER_STORE"  # "1": the launcher hosts the store; workers connect as clients
# How the launcher starts its workers: "spawn", a fresh interpreter each (safe with CUDA and with threads, at
# the price of importing torch and the toolkit again in every worker). The test suite's fork server
# (tests/helpers/forkserver.py) sets "fork" in its CPU-only children, whose imports are done and which have run
# no parallel torch op: the workers then begin from the launcher's memory (the store's server thread stays
# behind; they connect to it as clients, as spawned ones do) instead of a new interpreter.
WORKER_START_METHOD = "spawn"


def run(main: Callable, cfg: TrainConfig) -> None:
    """Run ``main(cfg)`` as this process's rank, or spawn ``--distributed-world-size`` workers.

    The process that stands for the whole run (the launcher, or rank 0 under torchrun/srun)
    holds the ``--save-dir`` lock meanwhile: a second run on the same folder stops at once.
    """
    plan = None if under_launcher() else slurm_plan(cfg)
    if not under_launcher():
        stop_on_sigint()
    try:
        with save_dir_lock(cfg, plan):
            _run(main, cfg, plan)
    except Stopped as stopped:  # the lock released: nothing left to finish
        _exit_now(stopped.code)


class Stopped(SystemExit):
    """The launcher was stopped by a signal (its workers too): exit with 128 + the signal's number."""


def _exit_now(code: int) -> None:
    """Exit without the interpreter's finalization: tearing torch's modules down takes about a second, and
    multiprocessing's resource tracker (a process of its own) waits for it; a stopped launcher has nothing
    left that needs it once its output is flushed."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def stop_on_sigint() -> None:
    """SIGINT stops the run whatever this process inherited: a shell starts a background job (``cmd &`` in a
    script, ``nohup``, CI) with SIGINT ignored, and Python then leaves it ignored, so ``kill -INT`` reached a
    run that went on training. The workers spawned after this inherit the default too."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def save_dir_lock(cfg: TrainConfig, plan: Optional[slurm.TaskLayout]):
    """The ``--save-dir`` lock when this process is the run's writer (nothing to hold otherwise)."""
    if under_launcher():
        writer = _rank() == 0 and os.environ.get(HOSTED_STORE_ENV) != "1"  # our spawner's workers: it holds it
    else:
        writer = plan is None or plan.start_rank == 0
    if not writer or cfg.checkpoint.no_save:
        return contextlib.nullcontext()
    save_dir = cfg.checkpoint.save_dir
    return folder_lock.hold_folder(save_dir, f"--save-dir {save_dir}", PROG)


def _run(main: Callable, cfg: TrainConfig, plan: Optional[slurm.TaskLayout]) -> None:
    if under_launcher():
        code = run_worker(main, cfg)
        if code:
            sys.exit(code)
        return
    if plan is not None:
        code = run_slurm_task(main, cfg, plan)
        if code:
            sys.exit(code)
        return
    nprocs = cfg.distributed.distributed_world_size
    if nprocs > 1:
        code = spawn(main, cfg, nprocs)
        if code:
            sys.exit(code)
        return
    try:  # one process: errors go to the caller (toolkit-train prints UserError as one line)
        main(cfg)
    finally:
        shutdown(ok=True)


def gpus_in_use(cpu: bool) -> int:
    """The GPUs a run may place one process on each (0 under --cpu or without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() and not cpu else 0


def default_world_size(world_size_given: bool, cpu: bool, port: int) -> Optional[int]:
    """fairseq's default --distributed-world-size, max(1, visible GPUs), when it changes anything.

    None (keep the configured value) when the flag was given, under torchrun, under Slurm
    (which sets the layout itself), with --cpu, or with fewer than two GPUs.
    """
    if world_size_given or under_launcher() or slurm.applies(port):
        return None
    gpus = gpus_in_use(cpu)
    return gpus if gpus > 1 else None


def slurm_plan(cfg: TrainConfig) -> Optional[slurm.TaskLayout]:
    """This srun task's place in the job (None when not started by srun with --distributed-port)."""
    dist_cfg = cfg.distributed
    plan = slurm.plan_from_env(dist_cfg.distributed_port, dist_cfg.distributed_world_size, gpus_in_use(cfg.common.cpu))
    if plan is None or plan.world_size == 1:
        return None
    return plan


def run_slurm_task(main: Callable, cfg: TrainConfig, plan: slurm.TaskLayout) -> int:
    """Run this task's rank (one task per GPU), or spawn its node's workers (one task per node)."""
    logger.info(
        f"Slurm: world size {plan.world_size}, ranks {plan.start_rank}.."
        f"{plan.start_rank + plan.local_procs - 1} here (node {plan.node_id}), rendezvous at "
        f"{plan.master_addr}:{plan.port}"
    )
    if plan.local_procs == 1:
        os.environ.update(plan.rank_env(0))
        return run_worker(main, cfg)
    return spawn(main, cfg, plan.local_procs, plan=plan)


# --- one rank ----------------------------------------------------------------------------


def _is_comm_error(e: BaseException) -> bool:
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text
        for s in (
            "gloo/transport",
            "Connection closed by peer",
            "Connection reset by peer",
            "Timed out waiting",
            "NCCL communicator was aborted",
            "Watchdog caught collective operation timeout",
        )
    )


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _wait_abort_message(seconds: float) -> str:
    """The reason another rank (or the launcher) gave for stopping the run, if any arrives in time."""
    hb = heartbeat._HEARTBEAT
    if hb is None:
        return ""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with hb._lock:
                if hb.store.check([hb._abort_key]):
                    return hb.store.get(hb._abort_key).decode()
        except Exception:
            return ""
        if time.monotonic() >= deadline:
            return ""
        time.sleep(0.1)


def run_worker(main: Callable, cfg: TrainConfig) -> int:
    """One rank: run ``main``, turn failures into one clear message, leave the group cleanly. Returns the exit code."""
    rank = _rank()
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get(HOSTED_STORE_ENV) != "1":
        parent_watch.watch_parent(os.getppid(), "the torchrun agent", f"rank {rank}")
    try:
        main(cfg)
    except (UserError, FloatingPointError) as e:
        # Usually every rank hits the same error: rank 0 says it. Another rank's own error still
        # reaches the user through the abort message the others print.
        shutdown(ok=False, error=e)
        if rank == 0:
            print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt as e:
        shutdown(ok=False, error=KeyboardInterrupt("interrupted"))
        if rank == 0 and isinstance(e, Interrupted):  # where the run stopped and what is saved, once
            print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 130
    except BaseException as e:  # noqa: B902 - report any failure, then exit non-zero
        if isinstance(e, SystemExit) and not e.code:
            shutdown(ok=True)
            return 0
        parent_watch.exit_if_orphaned()  # the launcher's death explains whatever failed
        if _is_comm_error(e):
            # Usually the consequence of another rank's failure: say which, if anyone knows.
            interval = heartbeat._HEARTBEAT.interval if heartbeat._HEARTBEAT else 1.0
            reason = _wait_abort_message(3 * interval + 1)
            where = heartbeat.describe_ranks()
            shutdown(ok=False, error=e)
            if reason:
                print(f"{PROG}: error: stopping rank {rank}: {reason}", file=sys.stderr, flush=True)
            else:
                print(
                    f"{PROG}: error: rank {rank}: communication with the other ranks failed "
                    f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})"
                    + (f"; last heartbeats: {where}" if where else ""),
                    file=sys.stderr,
                    flush=True,
                )
            return 1
        traceback.print_exc()
        shutdown(ok=False, error=e)
        return e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
    shutdown(ok=True)
    return 0


# --- the single-machine launcher -----------------------------------------------------------


def _spawned_worker(
    index: int,
    main: Callable,
    cfg_bytes: bytes,
    user_dir: Optional[str],
    layout: slurm.TaskLayout,
    threads: Optional[int],
    launcher_pid: int,
    inherited_listener: Optional[int] = None,
) -> None:
    """Entry point of a spawned worker (module level, so ``spawn`` can pickle it).

    ``inherited_listener``: a forked worker's copy of the launcher's listening socket, closed at once (only
    the launcher's store accepts on it)."""
    if inherited_listener is not None:
        os.close(inherited_listener)
    parent_watch.watch_parent(launcher_pid, "the toolkit-train launcher", f"rank {layout.start_rank + index}")
    os.environ.update({**layout.rank_env(index), HOSTED_STORE_ENV: "1"})
    if threads:
        torch.set_num_threads(threads)
    from toolkit.core import registry  # a spawned process starts with empty registries

    if user_dir:  # before the config is unpickled: it may hold a plugin's options dataclass
        registry.import_user_module(user_dir)
    registry.import_all_components()
    cfg = pickle.loads(cfg_bytes)
    _leave(run_worker(main, cfg))


def _leave(code: int) -> None:
    """End a spawned worker with ``code`` once every writer is flushed and closed, skipping the interpreter's
    finalization: there, gloo's teardown can abort a worker whose run succeeded (SIGABRT, "terminate called
    without an active exception", pytorch/pytorch#179291), which the launcher would report as a failed rank.
    A failing worker has printed its error already (:func:`run_worker`) and still leaves non-zero."""
    from toolkit.logging.writers import close_writers

    try:
        close_writers()
    except BaseException:  # noqa: B902 - e.g. a full disk under the log file: say so, and do not exit 0
        traceback.print_exc()
        sys.stderr.flush()
        code = code or 1
    os._exit(code)


def _describe_exit(rank: int, proc) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} (pid {proc.pid}) was killed by {name}"
    return f"rank {rank} (pid {proc.pid}) exited with code {code}"


def _threads_per_worker(nprocs: int) -> Optional[int]:
    if os.environ.get("OMP_NUM_THREADS"):
        return None  # the user's choice, applied by torch at import
    return max(1, (os.cpu_count() or 1) // nprocs)


def spawn(
    main: Callable, cfg: TrainConfig, nprocs: int, host: str = "127.0.0.1", plan: Optional[slurm.TaskLayout] = None
) -> int:
    """Host the store, spawn ``nprocs`` workers, watch them. Returns the exit code for the whole run; SIGINT or
    SIGTERM (forwarded to the workers) raises :class:`Stopped` once they are gone.

    With a Slurm ``plan`` (one task per node) the workers take the plan's ranks; the first
    node's task hosts the store at the plan's address, the others connect to it.
    """
    from toolkit.logging.setup import setup_logging

    setup_logging(None, rank=plan.start_rank if plan else 0)
    if torch.cuda.is_available() and not cfg.common.cpu and nprocs > torch.cuda.device_count():
        raise UserError(
            f"--distributed-world-size {nprocs}: this machine has {torch.cuda.device_count()} GPUs "
            f"(one process per GPU); lower it, or use --cpu"
        )
    timeout = float(cfg.distributed.heartbeat_timeout)
    listener = None
    if plan is None:  # the store's address is taken now; the store itself starts once the workers exist
        listener = _listen(host, cfg.distributed.distributed_port)
        plan = slurm.TaskLayout(
            master_addr=host,
            port=listener.getsockname()[1],
            world_size=nprocs,
            start_rank=0,
            local_procs=nprocs,
            local_rank_offset=0,
            local_world_size=nprocs,
            node_id=0,
        )
        store = None
    else:
        store = _host_store(plan.master_addr, plan.port, timeout, client=plan.node_id > 0)
    logger.info(f"spawning {nprocs} workers (store at {plan.master_addr}:{plan.port})")
    forked = WORKER_START_METHOD == "fork"
    os.environ[parent_watch.LAUNCHER_ENV] = str(os.getpid())  # each spawned worker dies with us from its start
    ctx = torch.multiprocessing.start_processes(
        _spawned_worker,
        args=(
            main,
            pickle.dumps(cfg),
            cfg.components.user_dir,
            plan,
            _threads_per_worker(nprocs),
            os.getpid(),
            listener.fileno() if forked and listener is not None else None,
        ),
        nprocs=nprocs,
        join=False,
        start_method=WORKER_START_METHOD,
    )
    os.environ.pop(parent_watch.LAUNCHER_ENV, None)
    procs = ctx.processes
    if listener is not None:  # after the fork: a forked worker must not inherit the store's server thread
        store = _host_store(host, plan.port, timeout, listen_fd=listener.detach())
    for index, proc in enumerate(procs):
        logger.info(f"rank {plan.start_rank + index}: pid {proc.pid}")

    stop_signal: List[int] = []

    def forward(signum, _frame):
        stop_signal.append(signum)
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        failed = _watch(procs)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if stop_signal:  # interrupted (Ctrl-C, scancel): the workers got the signal too
        _stop_all(procs, 5.0)
        raise Stopped(128 + stop_signal[0])
    if failed is None:
        return 0
    return _report_failure(plan, procs, failed, store, timeout, ctx.error_files)


def _report_failure(
    plan: slurm.TaskLayout, procs: List[Any], failed: int, store: Any, timeout: float, error_files: List[str]
) -> int:
    """Stop the other ranks after rank ``failed`` died and print why once; the run's exit code (1)."""
    reason = _describe_exit(plan.start_rank + failed, procs[failed])
    killed = procs[failed].exitcode is not None and procs[failed].exitcode < 0
    abort_key = heartbeat.abort_key()
    if killed:  # nobody else knows yet: tell the other ranks' heartbeats
        try:
            store.compare_set(abort_key, "", reason)
        except Exception:
            pass
    grace = max(2 * heartbeat.interval_for(timeout), 1.0)  # the others see the abort within one interval
    _stop_all(procs, grace)
    message = reason
    if not killed:
        try:  # a heartbeat's verdict (e.g. 'rank 1 sent no heartbeat') names the culprit better than an exit code
            if store.check([abort_key]):
                message = f"{store.get(abort_key).decode()} ({reason})"
        except Exception:
            pass
    if " failed: UserError: " not in message:  # a bad flag or file: the workers said it already, once
        print(f"{PROG}: error: {message}; stopped the other ranks", file=sys.stderr, flush=True)
    for f in error_files:
        try:
            os.unlink(f)
        except OSError:
            pass
    return 1


def _host_store(host: str, port: int, timeout: float, client: bool = False, listen_fd: Optional[int] = None):
    """The rendezvous store on ``--distributed-port`` (or a free port); a port in use is one line.

    ``client``: another node's launcher hosts it (Slurm, one task per node); connect to it.
    ``listen_fd``: a socket already bound and listening (:func:`_listen`); the store takes it over.
    """
    try:
        return dist.TCPStore(
            host,
            max(port, 0),
            world_size=None,
            is_master=not client,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=max(timeout, 30.0)),
            master_listen_fd=listen_fd,
        )
    except (RuntimeError, OSError) as e:  # DistNetworkError is a RuntimeError
        if _in_use(e):
            raise UserError(_port_in_use(host, port)) from None
        raise


def _listen(host: str, port: int) -> socket.socket:
    """Bind and listen on the store's address before any worker starts.

    Why: the store's server runs on threads, and a worker forked while one of them holds a lock can hang
    forever before it joins (seen as the other ranks timing out waiting for it). With the address held
    here, the workers start first and connect once the store takes this socket over; their connection
    waits in the listen backlog meanwhile."""
    try:
        return socket.create_server((host, max(port, 0)), backlog=1024)
    except OSError as e:
        if _in_use(e):
            raise UserError(_port_in_use(host, port)) from None
        raise


def _in_use(error: BaseException) -> bool:
    text = str(error)
    return (
        getattr(error, "errno", None) == errno.EADDRINUSE
        or "EADDRINUSE" in text
        or "address already in use" in text.lower()
    )


def _port_in_use(host: str, port: int) -> str:
    return (
        f"--distributed-port {port}: address already in use on {host}; choose another port, "
        f"or leave the flag out to use a free one"
    )


def _watch(procs) -> Optional[int]:
    """Wait until all workers exit (None) or one fails (its index; a killed one before one that errored)."""
    sentinels = {p.sentinel: i for i, p in enumerate(procs)}
    while sentinels:
        ready = multiprocessing.connection.wait(list(sentinels), timeout=1.0)
        exited = [sentinels.pop(s) for s in ready]
        for i in exited:
            procs[i].join()
        bad = [i for i in exited if procs[i].exitcode != 0]
        if bad:
            bad.sort(key=lambda i: (procs[i].exitcode >= 0, i))
            return bad[0]
    return None


def _stop_all(procs, grace: float) -> None:
    """Give the others ``grace`` seconds to stop on their own (the abort reaches them), then kill them."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            try:
                os.kill(p.pid, signal.SIGCONT)  # a stopped process handles SIGTERM only once continued
            except OSError:
                pass
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
