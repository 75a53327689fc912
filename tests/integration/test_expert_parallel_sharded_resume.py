"""Sharded checkpoints (``--use-sharded-state``) under expert parallelism: each rank of an ep group holds other
experts under the same parameter name, so the sharded format names each layer's whole [E, ...] stack (weights and
Adam moments gathered over the ep ranks, as a consolidated file does) and a rank loading it keeps its own experts.

Two ranks with FSDP2 and --expert-parallel-size 2 save after 3 updates; resumed at ep 2, the 4th update logs the
loss of the uninterrupted run and ends with its weights, their average (--store-ema) and moments (rtol 1e-4; an
expert's moment given to the wrong expert moves its weights by about the learning rate, 3e-3); resumed at ep 1 on
two ranks and in one process
(--update-freq 2: the same batches), the same loss; and toolkit-consolidate of the folder equals the consolidated
checkpoint the same run writes at update 3 without --use-sharded-state. A run that saves a sharded checkpoint
at update 3 and goes on ends as the reference too (the save gathers the moments into new tensors, leaving the
optimizer's own as they are). On four ranks at ep 2 (each rank's experts sharded by FSDP2 over their 2 holders),
the checkpoint resumes at ep 4 as the uninterrupted run.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.helpers import dist_helpers as H
from tests.helpers.dist_helpers import assert_logged_losses_match

pytestmark = pytest.mark.integration

SAVED_AT, UPDATES = 3, 4
TWO_RANKS = ["--distributed-world-size", "2", "--ddp-backend", "fully_sharded"]
EP2 = [*TWO_RANKS, "--expert-parallel-size", "2"]
ONE_PROC = ["--update-freq", "2"]


def train(data_bin, save_dir, *flags):
    args = [
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
    proc = H.run_train([data_bin] + args + list(flags), timeout=300)
    assert proc.returncode == 0, f"toolkit-train failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def consolidated(folder, out) -> dict:
    from toolkit_cli import consolidate

    consolidate.cli_main([str(folder), "-o", str(out)])
    return torch.load(out, map_location="cpu", weights_only=True)


def assert_same_state(got: dict, want: dict) -> None:
    """The weights, their average (--store-ema) and every Adam moment (whole expert stacks included) of two
    consolidated checkpoints."""
    assert got["model"].keys() == want["model"].keys()
    for name, tensor in want["model"].items():
        torch.testing.assert_close(got["model"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(
            got["extra_state"]["ema"][name], want["extra_state"]["ema"][name], rtol=1e-4, atol=1e-5, msg=f"ema {name}"
        )
    moments_got, moments_want = got["last_optimizer_state"]["state"], want["last_optimizer_state"]["state"]
    assert moments_got.keys() == moments_want.keys()
    assert moments_want["layers.0.mlp.experts.down_proj"]["exp_avg_sq"].shape[0] == 4  # the whole stack
    for name, entry in moments_want.items():
        for key, value in entry.items():
            torch.testing.assert_close(
                torch.as_tensor(moments_got[name][key]),
                torch.as_tensor(value),
                rtol=1e-4,
                atol=1e-5,
                msg=f"{name} {key}",
            )


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("ep_sharded") / "bin"))


def test_sharded_checkpoint_at_ep2_resumes_at_ep2_ep1_and_one_process_and_consolidates(data_bin, tmp_path):
    # the uninterrupted run, consolidated format: its checkpoint at update 3 and its state after update 4
    straight = train(
        data_bin, tmp_path / "straight", *EP2, "--max-update", str(UPDATES), "--save-interval-updates", str(SAVED_AT)
    )
    reference = H.losses(straight.stdout)
    saved_file = tmp_path / "straight" / f"checkpoint_1_{SAVED_AT}.pt"
    at_saved = torch.load(saved_file, map_location="cpu", weights_only=True)
    at_end = torch.load(tmp_path / "straight" / "checkpoint_last.pt", map_location="cpu", weights_only=True)

    saved = train(data_bin, tmp_path / "ep2", *EP2, "--use-sharded-state", "--max-update", str(SAVED_AT))
    assert_logged_losses_match(H.losses(saved.stdout), reference, range(1, SAVED_AT + 1))
    assert_same_state(consolidated(tmp_path / "ep2" / "checkpoint_last", tmp_path / "saved.pt"), at_saved)

    # a sharded save in the middle of a run leaves its optimizer as it was: the run goes on as the reference
    on = train(
        data_bin,
        tmp_path / "on",
        *EP2,
        "--use-sharded-state",
        "--max-update",
        str(UPDATES),
        "--save-interval-updates",
        str(SAVED_AT),
    )
    assert_logged_losses_match(H.losses(on.stdout), reference, range(1, UPDATES + 1))
    assert_same_state(consolidated(tmp_path / "on" / "checkpoint_last", tmp_path / "on.pt"), at_end)

    for copy in ("ep1", "one"):
        shutil.copytree(tmp_path / "ep2", tmp_path / copy)
    for save_dir, flags in (("ep2", EP2), ("ep1", TWO_RANKS), ("one", ONE_PROC)):
        resumed = train(data_bin, tmp_path / save_dir, *flags, "--use-sharded-state", "--max-update", str(UPDATES))
        assert f"@ {SAVED_AT} updates" in resumed.stdout + resumed.stderr, save_dir
        assert_logged_losses_match(H.losses(resumed.stdout), reference, range(SAVED_AT + 1, UPDATES + 1))
        if save_dir == "ep2":
            assert_same_state(consolidated(tmp_path / save_dir / "checkpoint_last", tmp_path / "end.pt"), at_end)


def test_experts_sharded_by_fsdp2_over_their_peers_resume_at_ep4(data_bin, tmp_path):
    """Four ranks at ep 2: each rank's two experts sharded by FSDP2 over the 2 ranks holding them
    (``ParallelDims.mesh(*EXPERT_PEERS)``); the sharded checkpoint at update 3 resumes at ep 4 (one expert a rank) with
    the 4th loss, weights and moments of the uninterrupted run (the same global batch: 4 ranks, --update-freq 1)."""
    four = ["--distributed-world-size", "4", "--ddp-backend", "fully_sharded"]
    straight = train(
        data_bin, tmp_path / "straight", *four, "--expert-parallel-size", "2", "--max-update", str(UPDATES)
    )
    saved = train(
        data_bin,
        tmp_path / "sharded",
        *four,
        "--expert-parallel-size",
        "2",
        "--use-sharded-state",
        "--max-update",
        str(SAVED_AT),
    )
    assert "each sharded by FSDP2 over the 2 ranks holding them" in saved.stdout + saved.stderr
    resumed = train(
        data_bin,
        tmp_path / "sharded",
        *four,
        "--expert-parallel-size",
        "4",
        "--use-sharded-state",
        "--max-update",
        str(UPDATES),
    )
    assert f"@ {SAVED_AT} updates" in resumed.stdout + resumed.stderr
    assert_logged_losses_match(H.losses(resumed.stdout), H.losses(straight.stdout), range(SAVED_AT + 1, UPDATES + 1))
    at_end = torch.load(tmp_path / "straight" / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert_same_state(consolidated(tmp_path / "sharded" / "checkpoint_last", tmp_path / "end.pt"), at_end)
