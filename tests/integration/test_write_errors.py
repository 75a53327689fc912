"""A save that hits a full disk or the file-size limit is one line, and leaves the last checkpoint intact.

The limit is the process's ``RLIMIT_FSIZE`` (``ulimit -f``), set in the command's process only (``run_cli``'s
``limits``), with SIGXFSZ ignored so that the write fails with EFBIG instead of killing it: no root needed.
"""

from __future__ import annotations

import hashlib
import os

import pytest

from tests.helpers import dist_helpers as H


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("wr") / "bin"))


def train(data_bin, save_dir, *flags, max_file_bytes=None):
    return H.run_cli(
        "toolkit_cli.train",
        [data_bin, *H.model_args(str(save_dir)), "--disable-validation", *flags],
        timeout=240,
        limits=None if max_file_bytes is None else {"max_file_bytes": max_file_bytes},
    )


def snapshot(folder) -> dict:
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.mark.parametrize(
    "mode",
    [[], ["--use-sharded-state"], ["--use-sharded-state", "--distributed-world-size", "2"]],
    ids=["consolidated", "sharded", "sharded-2-ranks"],
)
def test_file_too_large_at_save_is_one_line(data_bin, tmp_path, mode):
    first = train(data_bin, tmp_path, "--max-update", "3", *mode)
    assert first.returncode == 0, first.stderr[-3000:]
    before = snapshot(tmp_path)
    largest = max(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(tmp_path) for f in fs)
    failed = train(data_bin, tmp_path, "--max-update", "6", *mode, max_file_bytes=largest // 3)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr + failed.stdout, failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if "error" in line]
    target = os.path.join(str(tmp_path), "checkpoint_last" + ("" if mode else ".pt"))
    assert errors[0] == (
        f"toolkit-train: error: could not write {target}: File too large (errno 27); "
        f"the previous checkpoint_last.pt (update 3) is intact"
    ), failed.stderr[-3000:]
    assert snapshot(tmp_path) == before  # nothing half-written, no temporary file left
