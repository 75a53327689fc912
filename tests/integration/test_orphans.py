"""A worker never outlives its launcher: kill -9 or SIGTERM the launcher, and every process it started (the
workers, multiprocessing's resource tracker) is gone, also while the workers are still starting; SIGINT stops a
launcher whatever it inherited (a shell's background job ignores it).

Times: each test waits up to ``DEADLINE`` (generous: the machine is shared); the measured figures are in the
report of the change (about 0.1-0.5 s here, where the workers of a launcher killed during their start-up used
to live on for 3-12 s).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import dist_helpers as H
from tests.helpers import processes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

DEADLINE = 10.0


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("orphans") / "bin"))


def children(pid: int):
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def wait_for(path: str, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path, errors="replace") as f:
            content = f.read()
        if text in content:
            return content
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared:\n{content[-3000:]}")


def kill_launcher_and_check(launcher_cmd, tmp_path, workers_of):
    log = str(tmp_path / "out.log")
    with open(log, "w") as out:
        proc = processes.start(
            launcher_cmd, cwd=H.REPO_ROOT, env=H.subprocess_env(), stdout=out, stderr=subprocess.STDOUT
        )
    workers = []
    try:
        wait_for(log, '"num_updates": "2"', 180)
        workers = workers_of(proc.pid)
        assert len(workers) >= 2, workers  # the two ranks (and multiprocessing's resource tracker)
        proc.kill()  # SIGKILL: the launcher cannot tell anyone
        proc.wait()
        assert not processes.kill_survivors(workers, DEADLINE), "workers outlived their launcher"
        workers = []
    finally:
        processes.kill_survivors(workers, 0)
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.5)
    with open(log, errors="replace") as f:
        text = f.read()
    tail = text[text.index('"num_updates": "2"') :]
    assert "died; stopping this worker" in tail, tail[-3000:]
    assert "Traceback" not in tail and "frame #" not in tail, tail[-3000:]
    errors = [line for line in tail.splitlines() if "error" in line.lower()]
    assert errors and all("died; stopping this worker" in line for line in errors), errors


def train_flags(data_bin, save_dir):
    return (
        [data_bin]
        + H.model_args(str(save_dir))
        + ["--max-update", "100000", "--disable-validation", "--save-interval-updates", "5"]
    )


def test_spawned_workers_exit_when_the_launcher_is_killed(data_bin, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "toolkit_cli.train",
        *train_flags(data_bin, tmp_path / "s"),
        "--distributed-world-size",
        "2",
    ]
    kill_launcher_and_check(cmd, tmp_path, children)


def test_torchrun_workers_exit_when_the_agent_is_killed(data_bin, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(H.free_port()),
        "-m",
        "toolkit_cli.train",
        *train_flags(data_bin, tmp_path / "s"),
    ]
    kill_launcher_and_check(cmd, tmp_path, children)


def descendants(pid: int):
    """Every process below ``pid`` (children, their children, ...)."""
    out, todo = [], [pid]
    while todo:
        try:
            found = children(todo.pop())
        except FileNotFoundError:
            continue
        out += found
        todo += found
    return out


def start_launcher(data_bin, tmp_path, *extra, ignore_sigint=False):
    log = str(tmp_path / "out.log")
    with open(log, "w") as out:
        proc = processes.start(
            [sys.executable, "-m", "toolkit_cli.train", *train_flags(data_bin, tmp_path / "s"), *extra],
            cwd=H.REPO_ROOT,
            env=H.subprocess_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            ignore_sigint=ignore_sigint,
        )
    return proc, log


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_workers_end_with_a_launcher_stopped_while_they_start(signum, data_bin, tmp_path):
    """The launcher killed (or sent SIGTERM) right after spawning its workers, which import torch for seconds:
    they end with it, before they run any of the toolkit's code (so none prints the watch's line)."""
    proc, log = start_launcher(data_bin, tmp_path, "--distributed-world-size", "2")
    started = []
    try:
        wait_for(log, "rank 1: pid", 180)
        started = descendants(proc.pid)  # the two ranks and multiprocessing's resource tracker
        proc.send_signal(signum)
        assert proc.wait(timeout=DEADLINE) in (-signum, 128 + signum)  # killed by it, or stopped on it
        assert not processes.kill_survivors(started, DEADLINE), "processes outlived their launcher"
        started = []
    finally:
        processes.kill_survivors(started, 0)
    with open(log, errors="replace") as f:
        text = f.read()
    assert "stopping this worker" not in text and "Traceback" not in text, text[-3000:]


def test_sigint_stops_a_launcher_started_with_sigint_ignored(data_bin, tmp_path):
    """``toolkit-train ... &`` in a script (or nohup, CI) starts with SIGINT ignored; kill -INT still stops the
    launcher and its workers, with the one line of a Ctrl-C (one process: tests/unit/test_worker_exit.py)."""
    proc, log = start_launcher(data_bin, tmp_path, "--distributed-world-size", "2", ignore_sigint=True)
    started = []
    try:
        wait_for(log, '"num_updates": "2"', 180)
        started = descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
        assert not processes.kill_survivors(started, DEADLINE)
        started = []
    finally:
        processes.kill_survivors(started, 0)
    with open(log, errors="replace") as f:
        errors = [line for line in f.read().splitlines() if "error" in line]
    assert errors and re.fullmatch(r"toolkit-train: error: interrupted at update \d+; .*", errors[-1]), errors
