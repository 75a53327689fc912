"""The short fault suite: 3 runs killed with SIGKILL (during saves and between them) resume bit-identical.

Runs ``python -m benchmarks.faults --runs 3 --updates 4`` (the full version, ``--runs 20``, is
reported in the benchmarks README). Marked ``faults`` (``-m "not faults"`` leaves it out):
it starts 14 training processes (the last run is also restarted after it finished; then a SIGINT and a
SIGTERM in mid-save, consolidated and sharded, and a second writer on a running save dir). The same under
``--expert-parallel-size 2`` (the MoE family on 2 ranks; the launcher killed, its ranks following it): 2 runs. The
DeepSeek-V3 family (latent attention, its correction biases moving, a multi-token prediction depth): 1 run.
"""

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.dist_helpers import REPO_ROOT, subprocess_env


KILLS_ONLY = ["--finished-restarts", "0", "--signal-runs", "0", "--writer-runs", "0"]  # no restarts, signals, writers


@pytest.fixture(scope="module")
def forked_python(tmp_path_factory):
    """``TOOLKIT_PY`` for the benchmark's training runs: tests/helpers/fork_python.py, whose server (killed with
    the module) has imported torch and the toolkit once; each run forks from it (and says its pid, so that the
    benchmark's SIGKILL, SIGSTOP and signals reach the training process) instead of importing them again.
    ``TOOLKIT_TESTS_FORK=0``: fresh interpreters, as outside the tests."""
    from tests.helpers import fork_python

    if os.environ.get("TOOLKIT_TESTS_FORK", "1") == "0":
        yield {}
        return
    with fork_python.serving(str(tmp_path_factory.mktemp("forked_python"))) as env:
        yield env


def run_faults(tmp_path, runs: int, *flags: str, python_env=None) -> subprocess.CompletedProcess:
    """``benchmarks.faults`` over ``runs`` killed runs of 4 updates, seed 1, its work in ``tmp_path``; its training
    runs under ``python_env``'s ``TOOLKIT_PY`` (default: fresh interpreters)."""
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.faults", "--runs", str(runs), "--updates", "4", "--seed", "1", *flags]
        + ["--workdir", str(tmp_path)],
        cwd=REPO_ROOT,
        env=dict(subprocess_env(), **(python_env or {})),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.faults
def test_killed_runs_resume_bit_identical(tmp_path, forked_python):
    flags = ["--finished-restarts", "1", "--signal-runs", "2", "--writer-runs", "1"]
    proc = run_faults(tmp_path, 3, *flags, python_env=forked_python)
    out = proc.stdout + proc.stderr
    assert re.search(r"^matched: 3/3$", proc.stdout, re.M), out[-3000:]
    saves = int(re.search(r"kills during a save \(.*\): (\d+)/3", proc.stdout).group(1))
    assert saves >= 2, out[-3000:]  # at least half of the kills hit a save in progress
    assert re.search(r"^signal in mid-save matched: 2/2$", proc.stdout, re.M), out[-3000:]  # SIGINT and SIGTERM
    assert re.search(r"^two writers matched: 1/1$", proc.stdout, re.M), out[-3000:]
    assert proc.returncode == 0


@pytest.mark.faults
def test_killed_expert_parallel_runs_resume_bit_identical(tmp_path, forked_python):
    proc = run_faults(tmp_path, 2, *KILLS_ONLY, "--expert-parallel-size", "2", python_env=forked_python)
    assert re.search(r"^matched: 2/2$", proc.stdout, re.M), (proc.stdout + proc.stderr)[-3000:]
    assert "expert parallel: 2 MoE layers' experts over 2 ranks" in (tmp_path / "reference.log").read_text()
    assert proc.returncode == 0


@pytest.mark.faults
def test_killed_deepseek_v3_run_resumes_bit_identical(tmp_path, forked_python):
    flags = "--mtp-depth 1 --moe-bias-update-rate 0.01"
    proc = run_faults(
        tmp_path, 1, *KILLS_ONLY, "--arch", "deepseek_v3_tiny", f"--model-flags={flags}", python_env=forked_python
    )
    assert re.search(r"^matched: 1/1$", proc.stdout, re.M), (proc.stdout + proc.stderr)[-3000:]
    assert "mtp_loss" in (tmp_path / "reference.log").read_text()
    assert proc.returncode == 0
