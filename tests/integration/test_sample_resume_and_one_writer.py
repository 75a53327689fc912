"""Resumed runs count samples exactly whatever the new batching, and one save dir has one writer at a time.

(The refusals are in ``tests/integration/test_bad_inputs_writers_and_checksums.py``.)
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers import processes


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("bin") / "bin"))


def test_cli_resume_with_batch_size_8_counts_samples(data_bin, tmp_path):
    save = str(tmp_path / "save")
    first = H.run_train([data_bin, *H.model_args(save), "--max-update", "4", "--disable-validation"])
    assert first.returncode == 0, first.stderr[-3000:]
    saved = torch.load(f"{save}/checkpoint_last.pt", weights_only=True)["extra_state"]["train_iterator"]
    assert saved["samples_in_epoch"] == 16 and saved["sampler"]["batch_size"] == 4
    args = [a if a != "4" else "8" for a in H.model_args(save)]  # --batch-size 8
    resumed = H.run_train([data_bin, *args, "--max-update", "6", "--update-freq", "2", "--disable-validation"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = [line for line in resumed.stdout.splitlines() if "data position: 16 of the" in line]
    assert len(lines) == 1 and "| INFO |" in lines[0] and "--batch-size 4 -> 8" in lines[0], resumed.stdout[-3000:]
    assert sum("--update-freq 1 -> 2: resuming at sample 16" in line for line in resumed.stdout.splitlines()) == 1
    after = torch.load(f"{save}/checkpoint_last.pt", weights_only=True)["extra_state"]["train_iterator"]
    assert after["samples_in_epoch"] == 16 + 2 * 2 * 8 and after["sampler"]["batch_size"] == 4


def _wait_for(path: str, proc, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.1)


@pytest.mark.parametrize("extra", [[], ["--use-sharded-state"]])
def test_two_trainings_on_one_save_dir(data_bin, tmp_path, extra):
    save = str(tmp_path / "save")
    first = processes.start(
        [
            sys.executable,
            "-m",
            "toolkit_cli.train",
            data_bin,
            *H.model_args(save),
            "--max-update",
            "100000",
            "--save-interval-updates",
            "2",
            "--disable-validation",
            *extra,
        ],
        cwd=H.REPO_ROOT,
        env=H.subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(os.path.join(save, ".toolkit.lock"), first)
        second = H.run_train([data_bin, *H.model_args(save), "--max-update", "3", "--seed", "99", *extra])
    finally:
        processes.interrupt(first)  # killed if it ignores the Ctrl-C (and the fixture kills it on any failure)
    assert second.returncode == 1
    err = [line for line in second.stderr.splitlines() if line.strip()]
    assert (
        len(err) == 1
        and "Traceback" not in second.stderr
        and f"in use by toolkit-train (pid {first.pid} on host " in err[0]
    ), second.stderr[-3000:]
    assert "seed': 99" not in second.stdout and not glob.glob(f"{save}/*99*")
    assert not os.path.exists(os.path.join(save, ".toolkit.lock"))  # released by the first run at exit
