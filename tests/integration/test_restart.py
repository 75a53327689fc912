"""Restarting a finished run changes nothing; raising --max-update continues it exactly."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from tests.helpers import dist_helpers as H


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("restart") / "bin"))


def train(data_bin, save_dir, *flags):
    proc = H.run_train([data_bin] + H.model_args(str(save_dir)) + list(flags))
    assert proc.returncode == 0, f"toolkit-train failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc


def snapshot(folder) -> dict:
    """Every file under ``folder``: its bytes' hash and its modification time."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = (hashlib.sha256(f.read()).hexdigest(), os.stat(path).st_mtime_ns)
    return out


@pytest.mark.parametrize("sharded", [False, True], ids=["consolidated", "sharded"])
def test_restart_of_finished_run_is_a_no_op_and_more_updates_continue_exactly(data_bin, tmp_path, sharded):
    extra = ["--save-interval-updates", "3"] + (["--use-sharded-state"] if sharded else [])
    full = train(data_bin, tmp_path / "full", "--max-update", "10", *extra)
    train(data_bin, tmp_path / "run", "--max-update", "6", *extra)
    before = snapshot(tmp_path / "run")
    again = train(data_bin, tmp_path / "run", "--max-update", "6", *extra)
    assert "| done: checkpoint_last.pt is at update 6 >= --max-update 6; nothing to do" in again.stdout
    assert not H.losses(again.stdout)
    assert snapshot(tmp_path / "run") == before

    more = train(data_bin, tmp_path / "run", "--max-update", "10", *extra)
    assert sorted(H.losses(more.stdout)) == [7, 8, 9, 10]
    want = H.losses(full.stdout)
    assert all(H.losses(more.stdout)[u] == want[u] for u in range(7, 11))
    if sharded:
        from toolkit.checkpoint.safe_pickle import dcp_to_state_dict

        got_state = dcp_to_state_dict(str(tmp_path / "run" / "checkpoint_last"))["model"]
        want_state = dcp_to_state_dict(str(tmp_path / "full" / "checkpoint_last"))["model"]
    else:
        got_state = torch.load(tmp_path / "run" / "checkpoint_last.pt", weights_only=True)["model"]
        want_state = torch.load(tmp_path / "full" / "checkpoint_last.pt", weights_only=True)["model"]
    assert got_state.keys() == want_state.keys()
    assert all(torch.equal(got_state[k], want_state[k]) for k in want_state)
