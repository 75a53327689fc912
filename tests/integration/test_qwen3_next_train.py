"""Training the Qwen3-Next family with toolkit-train (``qwen3_next_tiny``: three gated DeltaNet layers and a gated
full-attention one, experts with a gated shared expert).

- --context-parallel-size 2 on two gloo ranks trains as one process with --update-freq 2: each rank's two chunks
  (the load-balanced layout, chunks r and 3 - r of 4) start from the recurrent state and convolution tail the
  earlier chunks leave (their affine maps all-gathered and composed), so the losses logged are the same (the
  logged digits) and the last checkpoint holds the same weights (fp32, rtol 1e-4); with --document-attention-mask
  the state restarts at each document inside and across the chunks, as one process's (those runs train a
  multi-token prediction depth too: ``--mtp-depth 1``, its weights compared with the others).
- A run killed with SIGKILL after update 3 (a checkpoint every 2) resumes to the uninterrupted run's weights and
  optimizer state bit for bit.
"""

import re
import signal
import subprocess
import sys

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers import processes
from tests.helpers.dist_helpers import assert_logged_losses_match

pytestmark = pytest.mark.integration

UPDATES = 4
# the documents' runs train a multi-token prediction depth too (its full-attention block under the shard and the mask)
MASKS = {"plain": [], "documents": ["--document-attention-mask", "--mtp-depth", "1"]}
CP2 = ["--distributed-world-size", "2", "--context-parallel-size", "2"]


def args(save_dir, *flags):
    argv = ["--task", "language_modeling", "--arch", "qwen3_next_tiny", "--optimizer", "adam", "--lr", "0.003"]
    argv += ["--batch-size", "2", "--tokens-per-sample", "32", "--seed", "3", "--num-workers", "0", "--cpu"]
    argv += ["--log-format", "json", "--log-interval", "1", "--save-dir", str(save_dir), "--disable-validation"]
    return argv + ["--no-epoch-checkpoints", "--update-freq", "2", "--save-interval-updates", "2", *flags]


def train(data_bin, save_dir, *flags):
    proc = H.run_train([data_bin, *args(save_dir, "--max-update", str(UPDATES), *flags)], timeout=300)
    assert proc.returncode == 0, f"toolkit-train failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def checkpoint(save_dir):
    return torch.load(f"{save_dir}/checkpoint_last.pt", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("qwen3_next_train") / "bin"))


@pytest.fixture(scope="module", params=sorted(MASKS))
def one_process(request, data_bin, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp(f"one_{request.param}")
    return dict(mask=request.param, save_dir=save_dir, proc=train(data_bin, save_dir, *MASKS[request.param]))


def logged(run, name: str) -> list:
    return [float(v) for v in re.findall(rf'"{name}": "([0-9.]+)"', run.stdout)]


def test_context_parallel_2_equals_one_process(data_bin, one_process, tmp_path):
    ranks, one = train(data_bin, tmp_path, *CP2, *MASKS[one_process["mask"]]), one_process["proc"]
    assert_logged_losses_match(H.losses(ranks.stdout), H.losses(one.stdout), range(1, UPDATES + 1))
    for name in ("gnorm", "mtp_loss"):  # the gradients' scale (Adam's updates would hide a wrong one), the depth's
        assert logged(ranks, name) == pytest.approx(logged(one, name), abs=2e-3), name
    assert len(logged(one, "mtp_loss")) == (UPDATES if one_process["mask"] == "documents" else 0)
    saved, reference = checkpoint(tmp_path)["model"], checkpoint(one_process["save_dir"])["model"]
    assert saved.keys() == reference.keys()
    for name, tensor in reference.items():  # fp32; the depth's loss sums over the ranks in another order
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=5e-5, msg=name)


@pytest.mark.parametrize("one_process", ["plain"], indirect=True)  # the resumed state is the model's and optimizer's
def test_killed_run_resumes_bitwise(data_bin, one_process, tmp_path):
    cmd = [sys.executable, "-m", "toolkit_cli.train", data_bin, *args(tmp_path, "--max-update", "1000")]
    proc = processes.start(
        cmd, cwd=H.REPO_ROOT, env=H.subprocess_env(None), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        processes.read_until(proc, lambda line: '"num_updates": "3"' in line, 240)
    finally:  # whatever happened, nothing this test started keeps running
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    resumed = train(data_bin, tmp_path)
    assert "@ 2 updates" in resumed.stdout + resumed.stderr, resumed.stdout[-2000:]
    got, want = checkpoint(tmp_path), checkpoint(one_process["save_dir"])
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    for key, state in want["last_optimizer_state"]["state"].items():
        for moment, value in state.items():
            assert torch.equal(got["last_optimizer_state"]["state"][key][moment], value), (key, moment)
