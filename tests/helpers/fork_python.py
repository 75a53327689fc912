"""A stand-in for ``python3`` whose ``-m MODULE ARGS`` commands fork from a process that has imported the toolkit.

Why: ``benchmarks/gpu.sh --dry-run`` (tests/integration/test_gpu_sh.py) runs each GPU figure's entry as
``$TOOLKIT_PY -m benchmarks.X ...`` with tiny shapes, and each fresh interpreter spends seconds importing torch,
dynamo and the toolkit before a step of a few milliseconds. The test points ``TOOLKIT_PY`` at this file
(``python3 -S tests/helpers/fork_python.py``): the shell script, its flags and each entry's parse and run stay
what they are; only the imports are paid once, by the server.

Two sides, one Unix socket (``$TOOLKIT_FORK_PYTHON``):

* the server (``python -m tests.helpers.fork_python --serve SOCKET``, with ``OMP_NUM_THREADS=1``) imports what
  the test fork server imports (``tests/helpers/forkserver.py``: one thread, no thread pool started), prints
  ``ready``, then forks one child per connection: the child takes the client's stdin/stdout/stderr (passed over
  the socket), environment and folder, runs the module as ``__main__`` (``runpy``, as ``python -m`` does) and
  sends back its exit status;
* the client (this file run as a script, site-less: it starts in milliseconds) sends its command and its three
  descriptors, forwards SIGINT/SIGTERM (``timeout``'s) to the child, and exits with the child's status. With
  ``$TOOLKIT_PY_PID_FILE`` set it writes the child's pid there (whole, by a rename) as soon as it has it: a
  caller that must SIGKILL or SIGSTOP the command (``benchmarks/faults.py``) signals the process that runs it.

A command's ranks (``--distributed-world-size N``) fork from the child too, as under ``tests/helpers/forkserver.py``.

Anything else runs in a real interpreter (``exec``): another form than ``-m`` (``-c``, a script, stdin), no
socket, and ``benchmarks.peak_memory`` with everything it starts, since it measures the resident memory of its
own process tree, which a forked child is not part of.
"""

import contextlib
import json
import os
import signal
import socket
import sys
from typing import Dict, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SOCKET_ENV = "TOOLKIT_FORK_PYTHON"
PID_FILE_ENV = "TOOLKIT_PY_PID_FILE"
REAL_PROCESS_TREE = ("benchmarks.peak_memory",)  # measures its child's process tree: real processes throughout
WARM_BENCHMARKS = ("benchmarks.train", "benchmarks.generate", "benchmarks.offload_profile", "benchmarks.figure")


def _exec_real(argv, env=None):
    """Become ``python ARGV`` (site on), with ``env`` (default: ours)."""
    os.execve(sys.executable, [sys.executable, *argv], os.environ if env is None else env)


def _receive(conn):
    """(request, fds) of one client: its JSON line and its stdin, stdout, stderr."""
    fds = []
    data = b""
    while not data.endswith(b"\n"):
        chunk, ancdata, _, _ = conn.recvmsg(65536, socket.CMSG_SPACE(3 * 4))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += list(memoryview(payload).cast("i"))
        if not chunk:
            raise EOFError("the client went away")
        data += chunk
    return json.loads(data), fds


def _child(conn, request, fds) -> None:
    """In the forked child: become the command, send its status, never return."""
    from tests.helpers.forkserver import _fork_ranks, exit_flushed, run_as_main

    code = 1
    try:
        _die_with_server()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        _threads_as_started()
        _fork_ranks()
        os.register_at_fork(after_in_child=conn.close)  # its ranks: the client waits for this child's end only
        conn.sendall(f"{os.getpid()}\n".encode())
        code = run_as_main(request["module"], request["argv"])
    except BaseException:  # what the interpreter prints for an uncaught exception
        import traceback

        traceback.print_exc()
    finally:
        exit_flushed(code, lambda: conn.sendall(f"{code}\n".encode()))


def _die_with_server() -> None:
    """SIGKILL this child when the server ends (Linux's PR_SET_PDEATHSIG): a test that kills the server leaves no
    command of its own running."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _threads_as_started() -> None:
    """torch's threads as a fresh interpreter with this environment would start them: the server imports with
    one (``OMP_NUM_THREADS=1``: no thread pool to copy into its children)."""
    import torch

    threads = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(threads) if threads and threads.isdigit() else len(os.sched_getaffinity(0)))


def serve(path: str) -> None:
    """Bind ``path``, import, say ``ready``, then fork a child per connection (reaping the ended ones)."""
    import importlib

    from tests.helpers import forkserver

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    for module in forkserver.WARM + WARM_BENCHMARKS:
        importlib.import_module(module)
    forkserver._warm_work()  # refuses to serve with a thread started
    signal.signal(signal.SIGTERM, _stop)
    print("ready", flush=True)
    try:
        _accept(listener)
    except SystemExit:  # SIGTERM: wait for the children (their time counts as this process's children's), then
        _reap(0)  # end without the interpreter's teardown of torch and DeepSpeed (seconds, for nothing)
        os._exit(0)


def _stop(signum, frame):
    raise SystemExit(0)


def _reap(options: int) -> None:
    """Wait for the ended children (``os.WNOHANG``), or for all of them (0)."""
    while True:
        try:
            if os.waitpid(-1, options)[0] == 0:
                return
        except ChildProcessError:
            return


def _accept(listener) -> None:
    """Fork a child per connection, for ever."""
    while True:
        conn, _ = listener.accept()
        _reap(os.WNOHANG)
        try:
            request, fds = _receive(conn)
        except (EOFError, OSError, ValueError):
            conn.close()
            continue
        if os.fork() == 0:
            listener.close()
            _child(conn, request, fds)
        for fd in fds:
            os.close(fd)
        conn.close()


def _client(argv) -> None:
    """Run ``python ARGV`` through the server when it can, else in a real interpreter; exit with its status."""
    path = os.environ.get(SOCKET_ENV)
    if not path or len(argv) < 2 or argv[0] != "-m" or argv[1] in REAL_PROCESS_TREE:
        env = dict(os.environ)
        if len(argv) > 1 and argv[1] in REAL_PROCESS_TREE:
            env.pop(SOCKET_ENV, None)  # what it starts is part of its tree too
        _exec_real(argv, env)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        _exec_real(argv)
    request = dict(module=argv[1], argv=argv[2:], env=dict(os.environ), cwd=os.getcwd())
    conn.sendmsg([(json.dumps(request) + "\n").encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, bytes(_fds()))])
    reader = conn.makefile("r")
    pid = int(reader.readline() or 0)
    if pid and os.environ.get(PID_FILE_ENV):
        _say_pid(os.environ[PID_FILE_ENV], pid)
    if pid:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, _: os.kill(pid, signum))
    status = reader.readline().strip()
    if not status:  # killed before it could say: a signal's status, as the shell reports one
        print(f"fork_python: {argv[1]} (pid {pid}) ended without a status", file=sys.stderr)
        sys.exit(137)
    sys.exit(int(status))


def _say_pid(path: str, pid: int) -> None:
    """``pid`` into ``path``, which appears whole (a reader never sees it half-written)."""
    with open(f"{path}.{os.getpid()}.tmp", "w") as f:
        f.write(f"{pid}\n")
    os.replace(f"{path}.{os.getpid()}.tmp", path)


@contextlib.contextmanager
def serving(folder: str) -> Iterator[Dict[str, str]]:
    """A server for the block (its socket in ``folder``; killed at the end, and its children with it): yields the
    environment that makes ``$TOOLKIT_PY`` commands fork from it."""
    import subprocess

    from tests.helpers import processes

    path = os.path.join(folder, "python.sock")
    server = processes.start(
        [sys.executable, "-m", "tests.helpers.fork_python", "--serve", path],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        processes.read_until(server, lambda line: line == "ready\n", timeout=300)
        yield {"TOOLKIT_PY": f"{sys.executable} -S {os.path.abspath(__file__)}", SOCKET_ENV: path}
    finally:
        server.terminate()  # it waits for its children (counted in the test's CPU time), then ends
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a child still running: killed with the server (PR_SET_PDEATHSIG)
            server.kill()
            server.wait()


def _fds():
    import array

    return array.array("i", [0, 1, 2])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        _client(sys.argv[1:])
