"""Run the command-line tools in subprocesses and read their fairseq-format log lines.

The one ``run_cli`` of the suite: every test that starts a toolkit command goes through it, so the
environment a command sees (the repo on PYTHONPATH, one intra-op thread, no inherited rank) is the
same everywhere.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from tests.helpers import REPO_ROOT
from tests.helpers.forkserver import ForkServer, apply_limits

LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) \| (\w+) \| ([\w.]+) \| (.*)$")

TINY_MODEL = [
    "--arch",
    "transformer_lm",
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "32",
    "--decoder-input-dim",
    "32",
    "--decoder-output-dim",
    "32",
    "--decoder-normalize-before",  # else 512 wide, post-norm
    "--decoder-ffn-embed-dim",
    "64",
    "--decoder-attention-heads",
    "2",
    "--dropout",
    "0.1",
    "--tokens-per-sample",
    "32",
    "--batch-size",
    "4",
    "--optimizer",
    "adam",
    "--lr",
    "0.003",
    "--lr-scheduler",
    "inverse_sqrt",
    "--warmup-updates",
    "5",
    "--num-workers",
    "0",
    "--cpu",
    "--log-format",
    "json",
    "--log-interval",
    "1",
    "--seed",
    "3",
]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    def records(self, tag: str) -> List[Dict[str, str]]:
        """The JSON dicts of the log lines with this logger name (train_inner, valid, train)."""
        out = []
        for line in self.stdout.splitlines():
            m = LOG_LINE.match(line)
            if m and m.group(3) == tag and m.group(4).startswith("{"):
                out.append(json.loads(m.group(4)))
        return out

    def losses(self) -> Dict[int, float]:
        return {int(r["num_updates"]): float(r["loss"]) for r in self.records("train_inner")}


_ENV_AT_IMPORT = dict(os.environ)  # before any test's monkeypatch: what the fork server starts with


def subprocess_env(extra: Optional[Dict[str, str]] = None, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of a command under test: the repo first, then whatever the caller's PYTHONPATH holds
    (packages installed with --target, as on the GPU machine, where torchao and deepspeed come from there);
    one thread per process (several run at once on two cores); no WORLD_SIZE/RANK leaking from a launcher."""
    env = dict(os.environ if base is None else base)
    pythonpath = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath})
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    env.update(extra or {})
    return env


def run_cli(
    module: str,
    args: Sequence[str],
    timeout: float = 300,
    env: Optional[Dict[str, str]] = None,
    limits: Optional[Dict[str, int]] = None,
) -> Run:
    """``python -m module args`` with the test environment; a ``toolkit_cli`` command (or a ``tests.helpers``
    program) is forked from the session's fork server (tests/helpers/forkserver.py: the same command, without
    paying the imports again). ``limits`` (``umask``, ``max_file_bytes``: ``forkserver.apply_limits``) are set
    in the command's process only."""
    if module.startswith(("toolkit_cli.", "tests.helpers.")) and _fork_ok():
        return _run_forked(module, args, timeout, subprocess_env(env), limits)
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=subprocess_env(env),
        cwd=REPO_ROOT,
        preexec_fn=(lambda: apply_limits(limits)) if limits else None,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


_SERVER: List[ForkServer] = []


def _fork_ok() -> bool:
    """Forking is for CPU machines: a process that touched CUDA cannot hand it to a forked child, so on a machine
    with an NVIDIA driver every command starts a fresh interpreter (as with TOOLKIT_TESTS_FORK=0)."""
    return os.environ.get("TOOLKIT_TESTS_FORK", "1") != "0" and not os.path.exists("/dev/nvidiactl")


def _run_forked(
    module: str, args: Sequence[str], timeout: float, env: Dict[str, str], limits: Optional[Dict[str, int]] = None
) -> Run:
    if not _SERVER or not _SERVER[0].alive():
        _SERVER[:] = [ForkServer(subprocess_env(base=_ENV_AT_IMPORT), REPO_ROOT)]
        atexit.register(_SERVER[0].close)
    with tempfile.TemporaryDirectory(prefix="toolkit-cli-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        code = _SERVER[0].run(module, [str(a) for a in args], env, REPO_ROOT, out, err, timeout, limits)
        with open(out, errors="replace") as f, open(err, errors="replace") as g:
            return Run(code, f.read(), g.read())


def run_train(
    argv: Sequence[str], env: Optional[Dict[str, str]] = None, timeout: float = 240, module: str = "toolkit_cli.train"
) -> Run:
    """toolkit-train with exactly these arguments (``train`` below adds the tiny model and a save dir)."""
    return run_cli(module, argv, timeout=timeout, env=env)


def train(data: str, save_dir: str, *extra: str, check: bool = True, **kw) -> Run:
    run = run_cli("toolkit_cli.train", [data, "--save-dir", save_dir, *TINY_MODEL, *extra], **kw)
    if check and run.returncode != 0:
        raise AssertionError(f"toolkit-train failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return run
