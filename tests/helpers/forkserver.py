"""Run ``python -m toolkit_cli.X ARGS`` as a child forked from a process that has already imported the toolkit.

Why: a fresh interpreter spends seconds importing torch, DTensor, DCP and dynamo before a tiny test run
does a few milliseconds of training; the integration tier starts a few hundred such commands. The
server here imports the command modules once, then forks one child per command. The child is still a
separate process started from a clean state (the server never trains, never starts a thread pool or a
process group): it gets its own environment, working folder, stdin from /dev/null and stdout/stderr into
files, runs the module as ``__main__`` exactly as ``python -m`` would (``runpy``) and exits with the
command's status; an uncaught exception prints its traceback and exits 1, as the interpreter does.

``tests/helpers/cli.run_cli`` uses it for ``toolkit_cli.*`` modules; ``TOOLKIT_TESTS_FORK=0`` turns it off
(every command then starts a fresh interpreter). A command's ranks (``--distributed-world-size N``) are forked
from the command too, not spawned (``TOOLKIT_TESTS_FORK_RANKS=0``: spawned, as outside the tests). Protocol on
the server's stdin/stdout, one JSON line a request: ``{"module", "argv", "env", "cwd", "out", "err", "limits"}``
(``limits``: :func:`apply_limits`); the
server says ``ready`` once its imports are done, then answers each request with the child's pid and its exit
status, each on a line.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import runpy
import select
import signal
import subprocess
import sys
import traceback
from typing import Callable, Dict, List, Optional, Tuple

WARM = (
    "toolkit_cli.train",
    "toolkit_cli.eval_lm",
    "toolkit_cli.generate",
    "toolkit_cli.validate",
    "toolkit_cli.export",
    "toolkit_cli.consolidate",
    "toolkit_cli.preprocess",
    "toolkit_cli.interactive",
    "toolkit_cli.hydra_train",
    "toolkit_cli.plan",
)
# The command modules import their work only after parsing (``--help`` without torch), so the work is warmed
# apart: torch, every registered component, the training loop and what it pulls in lazily (dynamo, which any
# torch.optim optimizer imports; inductor's compiler; FSDP2, DTensor, DCP). About 2 s of imports a command
# otherwise pays again (1,960 modules), and each of its ranks too where it forks them before its imports.
WORK = (
    "toolkit.train.train_loop",
    "toolkit.distributed.parallelize",
    "toolkit.checkpoint.stateful",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
)


def _child(request: Dict, proto_fds: Tuple[int, int]) -> None:
    """In the forked child: become the command, never return."""
    code = 1
    try:
        for fd in proto_fds:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
        os.dup2(os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        apply_limits(request.get("limits") or {})
        _fork_ranks()
        code = run_as_main(request["module"], request["argv"])
    except BaseException:  # what the interpreter prints for an uncaught exception
        traceback.print_exc()
    finally:
        exit_flushed(code)


def exit_flushed(code: int, then: Optional[Callable[[], None]] = None) -> None:
    """End this forked process with ``code`` after flushing its output (and running ``then``), without the
    interpreter's teardown, which belongs to the process it was forked from."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        if then is not None:
            then()
    finally:
        os._exit(code)


def run_as_main(module: str, argv: List[str]) -> int:
    """``python -m MODULE ARGV`` in this (forked) process: the exit status it would have, an uncaught exception's
    traceback printed as the interpreter prints it."""
    sys.argv = [module, *argv]
    sys.modules.pop(module, None)  # run as __main__ only, as ``python -m`` does (its imports stay)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def apply_limits(limits: Dict) -> None:
    """What a test's ``preexec_fn`` would set in a fresh command, set in the forked child instead: ``umask`` (the
    mode its files get) and ``max_file_bytes`` (``RLIMIT_FSIZE``, with SIGXFSZ ignored so that a write past it
    fails with EFBIG instead of killing the process). The command's ranks inherit both, as spawned ones do."""
    if limits.get("umask") is not None:
        os.umask(limits["umask"])
    if limits.get("max_file_bytes") is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["max_file_bytes"], limits["max_file_bytes"]))


def _fork_ranks() -> None:
    """A command with ``--distributed-world-size N`` forks its N workers from itself (already imported) instead
    of spawning N fresh interpreters: the launcher here is a CPU-only child that has run no torch op, so no
    thread pool or CUDA context is copied. ``TOOLKIT_TESTS_FORK_RANKS=0`` in the command's environment keeps
    ``spawn`` (a test of the spawned worker's own start-up)."""
    if os.environ.get("TOOLKIT_TESTS_FORK_RANKS", "1") != "0":
        from toolkit.distributed import launch

        launch.WORKER_START_METHOD = "fork"


def _warm_cpu_adam() -> None:
    """Loads DeepSpeed's CPU Adam op where it is built already: importing DeepSpeed and the extension loader's
    up-to-date check cost each ``--optimizer cpu_adam`` command and each of its ranks about 4 s otherwise. An op
    not built yet, or DeepSpeed absent, is left to the commands that need it (they build it, or report it)."""
    from toolkit.optim.deepspeed_op import cpu_adam_op_cached, load_deepspeed_cpu_adam

    try:
        if cpu_adam_op_cached():
            load_deepspeed_cpu_adam()
    except Exception:  # noqa: BLE001 - the command that needs it reports it in its own words
        pass


def _warm_work() -> None:
    """Imports ``WORK`` and the registries; refuses to serve if that started a thread (a child forked from a
    process with threads can inherit a held lock: the hang the launcher's store once caused)."""
    from toolkit.core import registry

    registry.import_all_components()
    for module in WORK:
        importlib.import_module(module)
    _warm_cpu_adam()
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads != 1:
        raise RuntimeError(f"the fork server has {threads} threads after its imports; it must have one")


def serve() -> None:
    """The server loop: requests on fd 0, answers on fd 1 (moved aside so a child's output cannot mix in)."""
    proto_in, proto_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    for module in WARM:
        importlib.import_module(module)
    _warm_work()
    os.write(proto_out, b"ready\n")
    reader = os.fdopen(proto_in, "r")
    for line in reader:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, (proto_in, proto_out))
        os.write(proto_out, f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        os.write(proto_out, f"{os.waitstatus_to_exitcode(status)}\n".encode())


class ForkServer:
    """The client side: one server process per test session, started on first use."""

    def __init__(self, env: Dict[str, str], cwd: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.forkserver"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=cwd,
            text=True,
            bufsize=1,
        )
        self.ready = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _line(self, deadline: Optional[float]) -> str:
        if deadline is not None:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline))
            if not ready:
                raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the test fork server exited")
        return line

    def run(
        self,
        module: str,
        argv: List[str],
        env: Dict[str, str],
        cwd: str,
        out: str,
        err: str,
        timeout: Optional[float],
        limits: Optional[Dict] = None,
    ) -> int:
        if not self.ready:  # the imports, once (a minute at most, even on a busy machine)
            assert self._line(300.0) == "ready\n"
            self.ready = True
        request = dict(module=module, argv=list(argv), env=env, cwd=cwd, out=out, err=err, limits=limits or {})
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = int(self._line(10.0))
        try:
            return int(self._line(timeout))
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._line(None)
            raise subprocess.TimeoutExpired([module, *argv], timeout)

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


if __name__ == "__main__":
    serve()
