"""``--lr-scheduler wsd`` through toolkit-train: a run stopped inside its decay, or in its stable phase and given a
decay on resume, logs the learning rates and losses of the uninterrupted run; ``--z-loss-coef`` logs ``z_loss``."""

from __future__ import annotations

import pytest

from tests.helpers import dist_helpers as H
from tests.helpers.cli import train

WSD = [
    "--lr-scheduler",
    "wsd",
    "--warmup-updates",
    "2",
    "--min-lr",
    "1e-4",
    "--decay-shape",
    "cosine",
    "--z-loss-coef",
    "1e-3",
    "--dropout",
    "0",
]


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("wsd") / "bin"))


@pytest.fixture(scope="module")
def uninterrupted(data_bin, tmp_path_factory):
    """10 updates decaying over updates 6..10."""
    return train(data_bin, str(tmp_path_factory.mktemp("full")), *WSD, "--max-update", "10", "--wsd-decay-start", "6")


def logged(run, key):
    return {int(r["num_updates"]): float(r[key]) for r in run.records("train_inner")}


def assert_continues(first, resumed, uninterrupted, stop):
    assert sorted(logged(resumed, "lr")) == list(range(stop + 1, 11))  # it resumed, not restarted
    for key in ("lr", "loss", "z_loss"):
        assert {**logged(first, key), **logged(resumed, key)} == logged(uninterrupted, key), key


def test_uninterrupted_run_decays_and_logs_z_loss(uninterrupted):
    lrs = logged(uninterrupted, "lr")
    assert lrs[1] < lrs[2] == lrs[5] == lrs[6] > lrs[7] > lrs[9] > lrs[10] == pytest.approx(1e-4)
    assert all(z > 0 for z in logged(uninterrupted, "z_loss").values())
    valid = uninterrupted.records("valid")
    assert valid and all("valid_z_loss" in r and "valid_loss" in r for r in valid)


def test_resume_mid_decay_continues_the_same_rates(data_bin, tmp_path, uninterrupted):
    # --total-num-update keeps the decay window of the 10-update run while this one stops at 8
    flags = [*WSD, "--total-num-update", "10", "--wsd-decay-start", "6"]
    first = train(data_bin, str(tmp_path), *flags, "--max-update", "8")
    resumed = train(data_bin, str(tmp_path), *flags, "--max-update", "10")
    assert_continues(first, resumed, uninterrupted, 8)


def test_stable_phase_checkpoint_resumed_with_a_decay(data_bin, tmp_path, uninterrupted):
    stable = train(data_bin, str(tmp_path), *WSD, "--max-update", "6", "--decay-fraction", "0")
    assert set(list(logged(stable, "lr").values())[1:]) == {0.003}  # after the warmup: constant to the end
    decayed = train(data_bin, str(tmp_path), *WSD, "--max-update", "10", "--wsd-decay-start", "6")
    assert_continues(stable, decayed, uninterrupted, 6)
