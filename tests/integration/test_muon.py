"""``toolkit-train --optimizer muon`` sharded, tensor-parallel and offloaded, against one process.

Orthogonalizing a shard is not orthogonalizing the matrix: each sharded matrix's momentum is gathered whole,
orthogonalized by its owner and scattered back, so N data-parallel ranks log the losses of one process with
``--update-freq N``. The sharded checkpoint resumes in one process; a run killed with SIGKILL resumes bitwise.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers import processes
from tests.helpers.dist_helpers import LOGGED_TOL

UPDATES = 6
REL_TOL = 1e-3  # the bound; measured: the logged values agree to the last printed digit


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("muon") / "bin"))


def muon_args(save_dir) -> list:
    args = H.model_args(str(save_dir))
    i = args.index("--optimizer")
    args[i + 1] = "muon"
    j = args.index("--lr")
    args[j + 1] = "0.05"
    return args + ["--muon-adamw-lr", "0.01", "--weight-decay", "0.01", "--disable-validation"]


def train(data_bin, save_dir, *flags):
    proc = H.run_train([data_bin] + muon_args(save_dir) + list(flags), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def assert_close(got, want):
    assert sorted(got) == sorted(want) and want
    for u in want:
        assert abs(got[u] - want[u]) <= REL_TOL * abs(want[u]) + LOGGED_TOL, (u, got[u], want[u])


@pytest.fixture(scope="module")
def one_process(data_bin, tmp_path_factory):
    """One process taking two batches per update: what two data-parallel replicas take."""
    proc = train(data_bin, str(tmp_path_factory.mktemp("one")), "--max-update", str(UPDATES), "--update-freq", "2")
    losses = H.losses(proc.stdout)
    assert losses[UPDATES] < losses[1] - 0.1, losses  # it learns
    return losses


def test_fully_sharded_two_ranks_equal_one_process_and_resume_in_one(data_bin, one_process, tmp_path):
    run = train(
        data_bin,
        tmp_path / "fsdp",
        "--max-update",
        str(UPDATES),
        "--distributed-world-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
        "--save-interval-updates",
        "3",
        "--use-sharded-state",
    )
    assert "--optimizer muon: 8 sharded matrices orthogonalized whole" in run.stdout
    assert "per step a rank gathers" in run.stdout
    assert_close(H.losses(run.stdout), one_process)
    # the sharded checkpoint of update 3 (Muon's momentum and AdamW's moments as shards) resumes in one process
    resume_dir = tmp_path / "resumed"
    resume_dir.mkdir()
    shutil.copytree(tmp_path / "fsdp" / "checkpoint_1_3", resume_dir / "checkpoint_last")
    resumed = train(data_bin, resume_dir, "--max-update", str(UPDATES), "--update-freq", "2")
    assert "loaded sharded checkpoint" in resumed.stdout
    assert_close(H.losses(resumed.stdout), {u: v for u, v in one_process.items() if u > 3})


def test_four_ranks_with_model_parallel_2_equal_one_process(data_bin, one_process, tmp_path):
    run = train(
        data_bin,
        tmp_path / "tp",
        "--max-update",
        str(UPDATES),
        "--distributed-world-size",
        "4",
        "--model-parallel-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
    )
    assert "tensor parallel: 2 ranks per replica, 2 data-parallel replicas" in run.stdout
    assert_close(H.losses(run.stdout), one_process)


def test_hybrid_shard_and_cpu_offload_equal_one_process(data_bin, one_process, tmp_path):
    """HSDP (2 replicas of 1 shard: the replicate axis owns the orthogonalization) and --cpu-offload (host-memory
    momentum; Newton-Schulz on the CPU here, there being no GPU)."""
    hsdp = train(
        data_bin,
        tmp_path / "hsdp",
        "--max-update",
        str(UPDATES),
        "--distributed-world-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
        "--sharding-strategy",
        "hybrid_shard",
        "--shard-group-size",
        "1",
    )
    assert_close(H.losses(hsdp.stdout), one_process)
    offload = train(
        data_bin,
        tmp_path / "offload",
        "--max-update",
        str(UPDATES),
        "--distributed-world-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
        "--cpu-offload",
    )
    assert_close(H.losses(offload.stdout), one_process)


def test_killed_run_resumes_bitwise(data_bin, tmp_path):
    """SIGKILL after update 5 (checkpoints every 2 updates): the resumed run ends with the uninterrupted run's
    weights and optimizer state, bit for bit."""
    killed = tmp_path / "killed"
    proc = processes.start(
        [sys.executable, "-m", "toolkit_cli.train", data_bin]
        + muon_args(killed)
        + ["--max-update", "1000", "--save-interval-updates", "2"],
        cwd=H.REPO_ROOT,
        env=H.subprocess_env(None),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    try:
        processes.read_until(proc, lambda line: '"num_updates": "5"' in line, 240)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    resumed = train(data_bin, killed, "--max-update", "8", "--save-interval-updates", "2")
    assert "@ 4 updates" in resumed.stdout or "@ 6 updates" in resumed.stdout, resumed.stdout[-2000:]
    train(data_bin, tmp_path / "straight", "--max-update", "8", "--save-interval-updates", "2")
    a = torch.load(killed / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    b = torch.load(tmp_path / "straight" / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    sa, sb = a["last_optimizer_state"]["state"], b["last_optimizer_state"]["state"]
    assert sa.keys() == sb.keys() and any("momentum_buffer" in s for s in sa.values())
    for i in sa:
        for name in sa[i]:
            assert torch.equal(sa[i][name], sb[i][name]), (i, name)


def test_llama_skips_decay_on_norms_and_embeddings_by_default(data_bin, tmp_path):
    """The family's default, said in one INFO line, and the groups it gave the optimizer (in the checkpoint)."""
    args, drop = (
        muon_args(tmp_path / "llama"),
        {"--decoder-input-dim": 2, "--decoder-output-dim": 2, "--decoder-normalize-before": 1, "--dropout": 2},
    )
    for flag, n in drop.items():
        i = args.index(flag)
        del args[i : i + n]
    llama = ["--arch", "llama", "--decoder-kv-heads", "1", "--max-update", "2"]
    run = H.run_train([data_bin] + args + llama, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [line for line in (run.stdout + run.stderr).splitlines() if "not applied to norms" in line]
    assert len(lines) == 1 and "LlamaLanguageModel's default; --decay-all-parameters" in lines[0]
    state = torch.load(tmp_path / "llama" / "checkpoint_last.pt", weights_only=True, map_location="cpu")
    groups = state["last_optimizer_state"]["param_groups"]
    assert {g["role"]: g["weight_decay"] for g in groups} == {
        "matrix": 0.01,
        "embedding": 0.0,
        "output": 0.01,
        "norm": 0.0,
    }
