"""Run a test's worker function on N ranks without N fresh interpreters.

``torch.multiprocessing.spawn`` from the test process starts every rank as a new interpreter that imports
torch and the toolkit again (seconds each on a busy two-core machine) before a worker that runs for a
second. ``spawn(fn, nprocs, *args)`` runs ``python -m tests.helpers.ranks`` through ``run_cli`` instead:
forked from the test fork server (tests/helpers/forkserver.py), that command forks its ranks
(``toolkit.distributed.launch.WORKER_START_METHOD``), each a separate process that calls
``fn(rank, *args)`` as ``mp.spawn`` would. Without the fork server, the ranks are spawned as before.
``fn`` must be a module-level function of an importable module; ``args`` JSON values (paths, numbers, lists).
"""

from __future__ import annotations

import importlib
import json
import os
import sys


def spawn(fn, nprocs: int, *args, timeout: float = 600) -> None:
    """``fn(rank, *args)`` on ranks 0..nprocs-1; fails the test with the ranks' output if one fails."""
    from tests.helpers.cli import run_cli

    run = run_cli(
        "tests.helpers.ranks", [f"{fn.__module__}:{fn.__name__}", str(nprocs), json.dumps(args)], timeout=timeout
    )
    assert run.returncode == 0, f"ranks failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"


def main(target: str, nprocs: int, args: list) -> None:
    import torch.multiprocessing as mp

    from toolkit.distributed import launch

    mp.start_processes(_rank, args=(target, os.getpid(), *args), nprocs=nprocs, start_method=launch.WORKER_START_METHOD)


def _rank(rank: int, target: str, command_pid: int, *args) -> None:
    """One rank: stops when the command that started it dies (a test's timeout kills only the command), then
    ``target`` (``module:function``)."""
    from toolkit.distributed import parent_watch

    parent_watch.watch_parent(command_pid, "the test's rank launcher", f"rank {rank}")
    module, name = target.split(":")
    getattr(importlib.import_module(module), name)(rank, *args)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]))
