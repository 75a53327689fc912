"""Multi-process training on CPU (gloo, 2 processes): equivalence, sharding, checkpoints, faults.

Every run is a real ``toolkit-train`` (``python -m toolkit_cli.train``) subprocess on a tiny
model (2 layers, dim 32, vocab 128) except the worker programs in tests/helpers/dist_helpers.py.

Losses are compared on the logged values (``--log-format json``, rounded to 3 decimals by
fairseq's meters, so within one unit of the last place) and, at full precision, on the final
parameters (relative difference under 1e-4) and in the strategies test.
"""

from __future__ import annotations

import math
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers import processes
from tests.helpers.dist_helpers import REL_TOL, assert_logged_losses_match, train

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")

UPDATES = 20


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("dist") / "bin"))


@pytest.fixture(scope="module")
def baseline(data_bin, tmp_path_factory):
    """One process, --update-freq 2: the global batch of two ranks with --update-freq 1."""
    save = tmp_path_factory.mktemp("baseline")
    proc = train(data_bin, save, "--max-update", str(UPDATES), "--update-freq", "2", "--disable-validation")
    return {"losses": H.losses(proc.stdout), "ckpt": str(save / "checkpoint_last.pt")}


@pytest.fixture(scope="module")
def fsdp_run(data_bin, tmp_path_factory):
    """Two ranks, FSDP2 full_shard, sharded checkpoints at update 10 and at the end; a log file and TensorBoard
    events too, and the workers spawned (fresh interpreters, not forked from the test fork server) with their
    stdout block-buffered (PYTHONUNBUFFERED empty), as outside the tests."""
    save, logs = tmp_path_factory.mktemp("fsdp"), tmp_path_factory.mktemp("fsdp_logs")
    proc = train(
        data_bin,
        save,
        "--max-update",
        str(UPDATES),
        "--distributed-world-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
        "--use-sharded-state",
        "--save-interval-updates",
        "10",
        "--disable-validation",
        "--log-file",
        str(logs / "train.log"),
        "--tensorboard-logdir",
        str(logs / "tb"),
        env={"PYTHONUNBUFFERED": "", "TOOLKIT_TESTS_FORK_RANKS": "0"},
    )  # spawned
    return {"losses": H.losses(proc.stdout), "dir": save, "stdout": proc.stdout, "stderr": proc.stderr, "logs": logs}


def model_state(path):
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def assert_same_params(a, b, tol=REL_TOL):
    assert a.keys() == b.keys()
    for k in a:
        diff = (a[k].double() - b[k].double()).norm() / max(b[k].double().norm().item(), 1e-12)
        assert diff < tol, (k, float(diff))


def test_c10d_two_ranks_match_one_process(data_bin, baseline, tmp_path):
    proc = train(
        data_bin,
        tmp_path,
        "--max-update",
        str(UPDATES),
        "--distributed-world-size",
        "2",
        "--ddp-backend",
        "c10d",
        "--disable-validation",
    )
    assert "training on 2 devices" in proc.stdout
    assert_logged_losses_match(H.losses(proc.stdout), baseline["losses"], range(1, UPDATES + 1))
    assert_same_params(model_state(tmp_path / "checkpoint_last.pt"), model_state(baseline["ckpt"]))


def test_two_ranks_on_one_cpu_log_mfu_at_most_100(fsdp_run):
    """The CPU peak is measured once per machine (with both ranks' threads) and split between the ranks;
    measuring it in each rank while the other computes once gave an MFU of 149%."""
    mfus = [float(m.group(1)) for m in re.finditer(r'"mfu": "([\d.]+)"', fsdp_run["stdout"])]
    assert mfus and max(mfus) <= 100.0, mfus
    peaks = [line for line in fsdp_run["stdout"].splitlines() if "GFLOP/s" in line]  # one figure, said once
    assert len(peaks) == 1 and "MFU peak:" in peaks[0] and "shared by 2 processes" in peaks[0], peaks


def test_spawned_workers_leave_every_writer_complete(fsdp_run):
    """The workers end with os._exit (gloo's teardown at finalization can abort them, pytorch#179291) after
    flushing and closing their writers: every stdout line, the log file and the TensorBoard events are whole."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert sorted(fsdp_run["losses"]) == list(range(1, UPDATES + 1))
    out = fsdp_run["stdout"].strip().splitlines()
    assert "done training in" in out[-1], fsdp_run["stdout"][-2000:]
    with open(fsdp_run["logs"] / "train.log") as f:
        logged = f.read().splitlines()
    assert [line for line in logged if " | train_inner | " in line] == [
        line for line in out if " | train_inner | " in line
    ]
    assert "done training in" in logged[-1]
    events = EventAccumulator(str(fsdp_run["logs"] / "tb" / "train_inner"))
    events.Reload()
    loss = {e.step: e.value for e in events.Scalars("loss")}
    assert sorted(loss) == list(range(1, UPDATES + 1))
    assert all(loss[u] == pytest.approx(fsdp_run["losses"][u], abs=1e-3) for u in loss)
    assert "terminate called" not in fsdp_run["stderr"] and "Traceback" not in fsdp_run["stderr"]


def test_a_failing_spawned_worker_reports_its_error_and_exits_non_zero(data_bin, tmp_path):
    proc = H.run_train(
        [data_bin]
        + H.model_args(str(tmp_path))
        + [
            "--max-update",
            "5",
            "--lr",
            "1e30",
            "--lr-scheduler",
            "fixed",
            "--distributed-world-size",
            "2",
            "--disable-validation",
        ],
        env={"PYTHONUNBUFFERED": "", "TOOLKIT_TESTS_FORK_RANKS": "0"},
    )  # spawned, as outside tests
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("toolkit-train: error: ")]
    assert "Traceback" not in proc.stderr and errors, proc.stderr[-2000:]
    assert "non-finite gradient norm" in errors[0]  # rank 0's own line, or the launcher's naming the rank
    assert re.search(r"rank \d .*failed: FloatingPointError", errors[-1]), errors
    assert "training on 2 devices" in proc.stdout  # the worker's buffered lines before the error came out


def test_fully_sharded_two_ranks_match_one_process(fsdp_run, baseline, tmp_path):
    assert "fully_sharded: full_shard on mesh (2,)" in fsdp_run["stdout"]
    assert_logged_losses_match(fsdp_run["losses"], baseline["losses"], range(1, UPDATES + 1))
    # The sharded checkpoint, consolidated into one file, holds the same parameters as the 1-process run.
    from toolkit_cli import consolidate

    out = tmp_path / "consolidated.pt"
    consolidate.cli_main([str(fsdp_run["dir"] / "checkpoint_last"), "-o", str(out)])
    assert_same_params(model_state(out), model_state(baseline["ckpt"]))
    state = torch.load(out, map_location="cpu", weights_only=True)
    assert state["extra_state"]["trainer"]["num_updates"] == UPDATES
    assert set(state["last_optimizer_state"]["state"]) == set(state["model"])
    with pytest.raises(SystemExit):  # refuses to overwrite without --force
        consolidate.cli_main([str(fsdp_run["dir"] / "checkpoint_last"), "-o", str(out)])


def test_consolidated_checkpoint_loads_for_evaluation(fsdp_run, data_bin, tmp_path):
    from toolkit import inference
    from toolkit_cli import consolidate

    out = tmp_path / "best.pt"
    consolidate.cli_main([str(fsdp_run["dir"] / "checkpoint_1_10"), "-o", str(out), "--no-optimizer"])
    assert not torch.distributed.is_initialized()
    models, task, _ = inference.load_ensemble(str(out), data_bin, torch.device("cpu"))
    tokens = torch.tensor([[2, 5, 6, 7]])
    assert torch.isfinite(models[0](tokens)).all()


def test_sharded_checkpoint_resumes_on_one_process(fsdp_run, baseline, data_bin, tmp_path):
    """Saved by 2 FSDP ranks at update 10, resumed by 1 plain process: the rest of the run is unchanged."""
    shutil.copytree(fsdp_run["dir"] / "checkpoint_1_10", tmp_path / "checkpoint_last")
    proc = train(data_bin, tmp_path, "--max-update", str(UPDATES), "--update-freq", "2", "--disable-validation")
    assert "loaded sharded checkpoint" in proc.stdout and "saved on 2 ranks" in proc.stdout
    assert_logged_losses_match(H.losses(proc.stdout), baseline["losses"], range(11, UPDATES + 1))
    assert_same_params(model_state(tmp_path / "checkpoint_last.pt"), model_state(baseline["ckpt"]))


def test_every_sharding_strategy_trains_the_same(data_bin, tmp_path):
    out = tmp_path / "strategies.json"
    proc = H.run_cli("tests.helpers.dist_helpers", ["strategies", data_bin, str(out)], timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    import json

    results = json.loads(out.read_text())
    # --update-freq: no gradient communication on the micro-batches before the last one
    assert results.pop("_sync_skipped") == {"c10d": True, "no_c10d": True, "fully_sharded": True}
    assert set(results) == set(H.STRATEGY_CONFIGS)
    for name, r in results.items():
        tol = 2e-2 if "bf16" in name else REL_TOL
        for got, want in zip(r["losses"], r["reference"]["losses"]):
            assert math.isfinite(got) and abs(got - want) <= tol * abs(want), (name, r["losses"], r["reference"])
        # the gradient norm is over all shards once: replicas (no_shard, hybrid) are not counted twice
        for got, want in zip(r["grad_norms"], r["reference"]["grad_norms"]):
            assert abs(got - want) <= max(10 * tol * abs(want), 2e-3), (
                name,
                r["grad_norms"],
                r["reference"]["grad_norms"],
            )
    total = results["full_shard+ac"]["param_numel"]
    for name in (
        "full_shard+ac",
        "shard_grad_op",
        "hybrid_shard_zero2",
        "full_shard+cpu_offload+offload_act+no_reshard",
    ):
        assert results[name]["kind"] == "fsdp"
        assert results[name]["local_param_numel"] <= 0.55 * total, name  # each rank holds half
    assert results["full_shard+ac"]["mesh"] == [2]
    assert results["no_shard"]["mesh"] == [2, 1] and results["no_shard"]["local_param_numel"] == total
    assert results["hybrid_shard"]["mesh"] == [2, 1]  # --shard-group-size 1: replicate across the 2 "nodes"
    assert results["hybrid_shard_zero2"]["mesh"] == [1, 2]  # default group: the ranks of this machine
    assert "Replicate(), Shard(dim=0)" in results["hybrid_shard"]["placements"]
    assert results["c10d+ac+offload_act"]["kind"] == "ddp" and results["no_c10d"]["kind"] == "no_c10d"


MEM_MODEL = [
    "--decoder-layers",
    "12",
    "--decoder-embed-dim",
    "512",
    "--decoder-ffn-embed-dim",
    "2048",
    "--decoder-attention-heads",
    "8",
]  # 38M parameters: 152 MB fp32, ~600 MB with grads + Adam
MEM_HEADROOM_MB = 480  # sharded on 2 ranks peaks at ~380 MB above the pre-model size; one process needs 600+


def test_deferred_init_trains_a_model_one_process_cannot_hold(data_bin, tmp_path):
    argv = [
        data_bin,
        "--task",
        "language_modeling",
        "--arch",
        "transformer_lm",
        *MEM_MODEL,
        "--dropout",
        "0",
        "--optimizer",
        "adam",
        "--lr",
        "0.0001",
        "--batch-size",
        "2",
        "--tokens-per-sample",
        "16",
        "--num-workers",
        "0",
        "--cpu",
        "--log-format",
        "json",
        "--log-interval",
        "1",
        "--max-update",
        "1",
        "--disable-validation",
        "--no-save",
        "--save-dir",
        str(tmp_path),
    ]
    # Keep the address space close to live memory: few malloc arenas, large blocks mmapped and unmapped on free.
    env = H.subprocess_env(
        {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "TOOLKIT_KEEP_CPU_MEMORY": "0"}
    )

    def run(nprocs, *extra):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.helpers.dist_helpers",
                "memcap",
                str(nprocs),
                str(MEM_HEADROOM_MB),
                "--",
                *argv,
                *extra,
            ],
            cwd=H.REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )

    single = run(1)
    assert single.returncode != 0, "one process should not fit the model + Adam state under the cap"
    assert "can't allocate memory" in single.stdout + single.stderr
    sharded = run(2, "--ddp-backend", "fully_sharded")
    out = sharded.stdout + sharded.stderr
    assert sharded.returncode == 0, out[-4000:]
    assert out.count("finished under the cap") == 2 and "address space capped" in out
    assert H.losses(sharded.stdout).get(1) is not None


def test_two_nodes_with_torchrun_rendezvous(data_bin, baseline, tmp_path):
    port = H.free_port()
    flags = (
        [data_bin]
        + H.model_args(str(tmp_path))
        + [
            "--max-update",
            "10",
            "--ddp-backend",
            "fully_sharded",
            "--sharding-strategy",
            "hybrid_shard",
            "--disable-validation",
        ]
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                f"test{port}",
                "-m",
                "toolkit_cli.train",
                *flags,
            ],
            cwd=H.REPO_ROOT,
            env=H.subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    out = next(o for o in outs if "train_inner" in o)  # the node that got rank 0
    assert "hybrid_shard on mesh (2, 1)" in out  # one rank per node: shard within the node, replicate across
    assert_logged_losses_match(H.losses(out), baseline["losses"], range(1, 11))


def _start(data_bin, save_dir, *flags, env=None, module="toolkit_cli.train"):
    return processes.start(
        [sys.executable, "-m", module, data_bin] + H.model_args(str(save_dir)) + list(flags),
        cwd=H.REPO_ROOT,
        env=H.subprocess_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )


def test_rank_killed_during_sharded_save_stops_run_and_resume_continues(data_bin, baseline, tmp_path):
    timeout = 10
    proc = _start(
        data_bin,
        tmp_path,
        "--max-update",
        "1000",
        "--distributed-world-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
        "--use-sharded-state",
        "--save-interval-updates",
        "5",
        "--heartbeat-timeout",
        str(timeout),
        "--disable-validation",
        env={"TOOLKIT_FAULT_KILL_IN_SAVE": "1:2"},  # rank 1 dies inside its 2nd save (update 10)
        module="tests.helpers.faulty_train",
    )
    try:
        lines, t_kill = processes.read_until(proc, lambda l: "killing rank 1" in l, 180)
        rest = proc.communicate(timeout=60)[0]
        elapsed = time.monotonic() - t_kill
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + rest
    assert proc.returncode != 0
    # Stopped by the launcher seeing rank 1 die, not by the heartbeat's timeout (what is asserted is the
    # reason; the bound below only guards against a hang, so a slow machine cannot fail the test).
    assert "rank 1 (pid" in out and "SIGKILL" in out, out[-2000:]
    assert "sent no heartbeat for" not in out and "never sent a heartbeat" not in out, out[-2000:]
    assert elapsed < 60, f"the run took {elapsed:.1f} s to stop"
    # checkpoint_last is still the complete save of update 5; the interrupted one is a temporary folder.
    last = tmp_path / "checkpoint_last"
    meta = torch.load(last / "meta.pt", weights_only=True)
    assert meta["extra_state"]["trainer"]["num_updates"] == 5
    assert (last / ".metadata").exists()
    assert not (tmp_path / "checkpoint_1_10").exists()
    assert not glob.glob(str(tmp_path / ".checkpoint_1_10.*.tmp" / ".metadata"))
    # Resume (one process now) continues exactly where the last good checkpoint left off.
    resumed = train(data_bin, tmp_path, "--max-update", "8", "--update-freq", "2", "--disable-validation")
    assert "@ 5 updates" in resumed.stdout
    assert_logged_losses_match(H.losses(resumed.stdout), baseline["losses"], range(6, 9))


def test_frozen_rank_is_named_within_the_heartbeat_timeout(data_bin, tmp_path):
    timeout = 8
    proc = _start(
        data_bin,
        tmp_path,
        "--max-update",
        "100000",
        "--distributed-world-size",
        "2",
        "--heartbeat-timeout",
        str(timeout),
        "--no-save",
        "--disable-validation",
    )
    pid = None
    try:
        lines, _ = processes.read_until(proc, lambda l: '"num_updates": "3"' in l, 180)
        pid = int(next(l for l in lines if "rank 1: pid" in l).rsplit(" ", 1)[1])
        os.kill(pid, signal.SIGSTOP)  # frozen: alive, holds its sockets, does nothing
        rest = proc.communicate(timeout=600)[0]  # a hang guard only: how fast is judged on the heartbeat's clock
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode != 0
    # Named: the frozen rank and its pid, with the silence the heartbeat measured on its own clock, which is
    # past its detection threshold (stale_after: never early). The wall's time to stop is not asserted: on a
    # busy machine the watcher thread itself runs late, and that bound failed under load.
    from toolkit.distributed.heartbeat import interval_for

    found = re.search(r"rank 1 \(\S+, pid (\d+)\) sent no heartbeat for (\d+) s \(--heartbeat-timeout (\d+)\)", rest)
    assert found, rest[-2000:]
    interval = interval_for(timeout)
    stale_after = max(timeout - 3 * interval, interval)
    assert int(found.group(1)) == pid and int(found.group(3)) == timeout
    assert round(stale_after) <= int(found.group(2)), found.group(0)
    assert "last seen after" in rest
