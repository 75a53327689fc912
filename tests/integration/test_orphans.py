"""A worker never outlives its launcher: kill -9 the launcher, and every worker is gone within 10 s."""

from __future__ import annotations

import os
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
