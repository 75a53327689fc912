"""Resume on another data-parallel size (issue 22, item 6): a run saved at W ranks resumes at W' and trains
the same batches, so its losses equal the run that never stopped (the 2-proc = 1-proc tolerance).

Two ranks with --update-freq 1 read, per update, the same two batches as one rank with --update-freq 2
(the iterator's sharding), so one baseline serves both directions.
"""

import pytest

from tests.helpers import dist_helpers as H
from tests.helpers.dist_helpers import assert_logged_losses_match, train

SAVED_AT, UPDATES = 5, 10
ONE_PROC = ["--update-freq", "2"]
TWO_PROCS = ["--distributed-world-size", "2", "--ddp-backend", "c10d"]


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("resume_ws") / "bin"))


@pytest.fixture(scope="module")
def uninterrupted(data_bin, tmp_path_factory):
    proc = train(
        data_bin, tmp_path_factory.mktemp("whole"), "--max-update", str(UPDATES), *ONE_PROC, "--disable-validation"
    )
    return H.losses(proc.stdout)


@pytest.mark.parametrize(
    "before, after",
    [(TWO_PROCS, ONE_PROC), (ONE_PROC, TWO_PROCS)],
    ids=["2->1 with --update-freq 2", "1 with --update-freq 2 -> 2"],
)
def test_resume_on_another_world_size_equals_the_uninterrupted_run(data_bin, uninterrupted, tmp_path, before, after):
    first = train(data_bin, tmp_path, "--max-update", str(SAVED_AT), *before, "--disable-validation")
    assert_logged_losses_match(H.losses(first.stdout), uninterrupted, range(1, SAVED_AT + 1))
    resumed = train(data_bin, tmp_path, "--max-update", str(UPDATES), *after, "--disable-validation")
    assert_logged_losses_match(H.losses(resumed.stdout), uninterrupted, range(SAVED_AT + 1, UPDATES + 1))
