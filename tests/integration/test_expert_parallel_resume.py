"""Checkpoints across expert-parallel sizes (issue 32): a consolidated checkpoint holds whole expert stacks and
their whole Adam moments, so one saved at ``--expert-parallel-size 2`` resumes on one process (EP 1) and on four
ranks at EP 4 (one expert of moe_tiny's 4 per rank) or at EP 2 (each expert half on 2 ranks), one saved by one
process resumes at EP 2, an EP 2 run killed with SIGKILL resumes bit for bit, and cpu_adam's fp16 moments (one
scale per tensor) are saved on one scale.

Every run reads the same 4 batches per update: one process with ``--update-freq 4``, two ranks with
``--update-freq 2``, four ranks with 1 (the iterator's sharding), so one uninterrupted run is the reference of all.
Resumed runs log its losses (the 2-proc = 1-proc tolerance) and end with its weights, their average
(``--store-ema``, saved whole as well) and its optimizer state to float noise (``rtol 1e-4, atol 1e-5``; measured: 3e-6 at most): a moment lost or given to the wrong expert would
move the weights by about the learning rate, 3e-3.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers import processes
from tests.helpers.dist_helpers import assert_logged_losses_match

pytestmark = pytest.mark.integration

SAVED_AT, UPDATES = 2, 4
ONE_PROC = ["--update-freq", "4"]
EP1_ON_1 = ONE_PROC  # the same run: expert parallelism of size 1 is no expert parallelism
EP2_ON_2 = ["--distributed-world-size", "2", "--expert-parallel-size", "2", "--update-freq", "2"]
EP4_ON_4 = ["--distributed-world-size", "4", "--expert-parallel-size", "4"]
EP2_ON_4 = ["--distributed-world-size", "4", "--expert-parallel-size", "2"]  # two replicas of each expert half
RANK_PID = re.compile(r"\brank \d+: pid (\d+)\s*$")  # the launcher's line naming each rank's process


def args(save_dir) -> list:
    return [
        "--task",
        "language_modeling",
        "--arch",
        "moe_tiny",
        "--optimizer",
        "adam",
        "--lr",
        "0.003",
        "--batch-size",
        "4",
        "--tokens-per-sample",
        "32",
        "--seed",
        "3",
        "--num-workers",
        "0",
        "--cpu",
        "--log-format",
        "json",
        "--log-interval",
        "1",
        "--save-dir",
        str(save_dir),
        "--disable-validation",
        "--no-epoch-checkpoints",
        "--store-ema",
        "--ema-decay",
        "0.5",
    ]


def train(data_bin, save_dir, *flags):
    proc = H.run_train([data_bin] + args(save_dir) + list(flags), timeout=300)
    assert proc.returncode == 0, f"toolkit-train failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def last_checkpoint(save_dir) -> dict:
    return torch.load(os.path.join(save_dir, "checkpoint_last.pt"), map_location="cpu", weights_only=True)


def assert_same_state(got: dict, want: dict, exact: bool = False) -> None:
    """The weights, their average (--store-ema) and every optimizer moment (whole expert stacks included) of two
    checkpoints agree."""
    check = (
        (lambda a, b, msg: torch.testing.assert_close(a, b, rtol=0, atol=0, msg=msg))
        if exact
        else (lambda a, b, msg: torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=msg))
    )
    assert got["model"].keys() == want["model"].keys()
    for name, tensor in want["model"].items():
        check(got["model"][name], tensor, name)
        check(got["extra_state"]["ema"][name], want["extra_state"]["ema"][name], f"ema {name}")
    moments_got, moments_want = got["last_optimizer_state"]["state"], want["last_optimizer_state"]["state"]
    assert moments_got.keys() == moments_want.keys()
    assert "exp_avg_sq" in moments_want["layers.0.mlp.experts.down_proj"]
    for name, entry in moments_want.items():
        for key, value in entry.items():
            check(torch.as_tensor(moments_got[name][key]), torch.as_tensor(value), f"{name} {key}")


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("ep_resume") / "bin"))


@pytest.fixture(scope="module")
def uninterrupted(data_bin, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("uninterrupted")
    proc = train(data_bin, save_dir, "--max-update", str(UPDATES), *ONE_PROC)
    return dict(losses=H.losses(proc.stdout), state=last_checkpoint(save_dir))


def test_saved_at_ep2_resumes_at_ep1_at_ep4_and_at_ep2_on_4_ranks(data_bin, uninterrupted, tmp_path):
    first = tmp_path / "ep1"
    saved = train(data_bin, first, "--max-update", str(SAVED_AT), *EP2_ON_2)
    assert_logged_losses_match(H.losses(saved.stdout), uninterrupted["losses"], range(1, SAVED_AT + 1))
    saved_experts = last_checkpoint(first)["model"]["layers.0.mlp.experts.gate_proj"]
    assert saved_experts.shape[0] == 4  # whole stacks, gathered from the two ranks' halves
    for copy in ("ep4", "ep2_on_4"):
        shutil.copytree(first, tmp_path / copy)
    for save_dir, flags in ((first, EP1_ON_1), (tmp_path / "ep4", EP4_ON_4), (tmp_path / "ep2_on_4", EP2_ON_4)):
        resumed = train(data_bin, save_dir, "--max-update", str(UPDATES), *flags)
        assert f"@ {SAVED_AT} updates" in resumed.stdout + resumed.stderr
        assert_logged_losses_match(H.losses(resumed.stdout), uninterrupted["losses"], range(SAVED_AT + 1, UPDATES + 1))
        assert_same_state(last_checkpoint(save_dir), uninterrupted["state"])


def test_saved_by_one_process_resumes_at_ep2(data_bin, uninterrupted, tmp_path):
    train(data_bin, tmp_path, "--max-update", str(SAVED_AT), *EP1_ON_1)
    resumed = train(data_bin, tmp_path, "--max-update", str(UPDATES), *EP2_ON_2)
    assert "expert parallel: 2 MoE layers' experts over 2 ranks" in resumed.stdout + resumed.stderr
    assert_logged_losses_match(H.losses(resumed.stdout), uninterrupted["losses"], range(SAVED_AT + 1, UPDATES + 1))
    assert_same_state(last_checkpoint(tmp_path), uninterrupted["state"])


def test_fp16_adam_stats_of_the_experts_are_saved_on_one_scale(data_bin, tmp_path):
    """cpu_adam's --fp16-adam-stats keeps each moment in fp16 over one scale per tensor, which each ep rank takes
    from its own experts: the saved whole stack is put on the ep ranks' largest scale, so it holds the moments of
    one process (to fp16 rounding: measured 8e-4 of the largest; stacked on rank 0's scale, 2.6e-2)."""
    fp16 = ["--optimizer", "cpu_adam", "--fp16-adam-stats", "--max-update", str(SAVED_AT)]
    train(data_bin, tmp_path / "one", *fp16, *ONE_PROC)
    train(data_bin, tmp_path / "ep2", *fp16, *EP2_ON_2)
    got, want = (last_checkpoint(tmp_path / d)["last_optimizer_state"]["state"] for d in ("ep2", "one"))
    for name in (n for n in want if ".experts." in n):
        for key in ("exp_avg", "exp_avg_sq"):
            true = {
                side: entry[name][key].float() * entry[name][f"{key}_scale"]
                for side, entry in (("got", got), ("want", want))
            }
            largest = true["want"].abs().max()
            assert (true["got"] - true["want"]).abs().max() <= 3e-3 * largest, (name, key)
            torch.testing.assert_close(got[name][f"{key}_scale"], want[name][f"{key}_scale"], rtol=1e-3, atol=0)


def test_killed_ep2_run_resumes_bitwise(data_bin, tmp_path):
    """SIGKILL to the launcher after update 3 (checkpoints every 2 updates; its ranks die with it): the resumed run
    ends with the weights and optimizer state of the EP 2 run that never stopped, bit for bit."""
    killed, every_2 = tmp_path / "killed", ["--save-interval-updates", "2"]
    proc = processes.start(
        [sys.executable, "-m", "toolkit_cli.train", data_bin]
        + args(killed)
        + EP2_ON_2
        + every_2
        + ["--max-update", "1000"],
        cwd=H.REPO_ROOT,
        env=H.subprocess_env(None),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    ranks = []
    try:
        lines, _ = processes.read_until(proc, lambda line: '"num_updates": "3"' in line, 240)
        ranks = [int(m.group(1)) for m in map(RANK_PID.search, lines) if m]
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        assert len(ranks) == 2, "".join(lines[-30:])
        assert not processes.kill_survivors(ranks, 30), f"ranks {ranks} outlived their killed launcher"
    finally:  # whatever happened, nothing this test started keeps running
        processes.kill_survivors(ranks, 0)
    resumed = train(data_bin, killed, "--max-update", "6", *EP2_ON_2, *every_2)
    assert re.search(r"@ [24] updates", resumed.stdout + resumed.stderr), resumed.stdout[-2000:]
    train(data_bin, tmp_path / "straight", "--max-update", "6", *EP2_ON_2, *every_2)
    assert_same_state(last_checkpoint(killed), last_checkpoint(tmp_path / "straight"), exact=True)
