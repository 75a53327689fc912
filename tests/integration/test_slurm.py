"""Slurm's srun layout as real processes: two tasks of one process each, and one task per node spawning
its workers, train exactly like the same two ranks spawned by ``--distributed-world-size 2``.

The layout arithmetic (against fairseq's ``_infer_slurm_init`` formulas) is in tests/unit/test_slurm.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.helpers import dist_helpers as H

UPDATES = 5


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("slurm") / "bin"))


def train_args(data_bin, save_dir, *extra):
    return [data_bin] + H.model_args(str(save_dir)) + ["--max-update", str(UPDATES), "--disable-validation", *extra]


def slurm_env(layout, procid):
    nnodes, ntasks = layout
    return {
        "SLURM_JOB_NODELIST": "127.0.0.1",
        "SLURM_NNODES": str(nnodes),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(procid),
        "SLURM_NODEID": "0",
    }


@pytest.fixture(scope="module")
def spawned(data_bin, tmp_path_factory):
    save = tmp_path_factory.mktemp("spawned")
    proc = H.run_train(train_args(data_bin, save, "--distributed-world-size", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return H.losses(proc.stdout), torch.load(save / "checkpoint_last.pt", weights_only=True)["model"]


def assert_same_run(losses, ckpt, spawned):
    want_losses, want_model = spawned
    assert sorted(losses) == list(range(1, UPDATES + 1)) and losses == want_losses
    model = torch.load(ckpt, weights_only=True)["model"]
    assert model.keys() == want_model.keys()
    for k in model:
        torch.testing.assert_close(model[k], want_model[k], rtol=1e-5, atol=1e-6)


def test_srun_one_task_per_process_trains_like_spawned_ranks(data_bin, spawned, tmp_path):
    port = H.free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "toolkit_cli.train",
                *train_args(data_bin, tmp_path, "--distributed-port", str(port)),
            ],
            cwd=H.REPO_ROOT,
            env=H.subprocess_env(slurm_env((1, 2), task)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for task in range(2)
    ]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    assert "Slurm: world size 2, ranks 0..0 here" in outs[0]
    assert "Slurm:" not in outs[1]  # the launch's INFO lines come once, from task 0 (as from torchrun's rank 0)
    assert "training on 2 devices" in outs[0]
    assert_same_run(H.losses(outs[0]), tmp_path / "checkpoint_last.pt", spawned)


def test_srun_one_task_per_node_spawns_its_workers(data_bin, spawned, tmp_path):
    port = H.free_port()
    proc = H.run_train(
        train_args(data_bin, tmp_path, "--distributed-port", str(port), "--distributed-world-size", "2"),
        env=slurm_env((1, 1), 0),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Slurm: world size 2, ranks 0..1 here (node 0)" in proc.stdout + proc.stderr
    assert_same_run(H.losses(proc.stdout), tmp_path / "checkpoint_last.pt", spawned)
