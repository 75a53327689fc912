"""toolkit-validate prints the training run's own ``valid`` line for the same checkpoint.

One process: loss, ppl, wpb and bsz equal on two splits. Two ranks (fully_sharded, sharded
state): loss and ppl equal (the ranks split the batches; the sums are the same), read from the
sharded folder directly.
"""

from __future__ import annotations

import pytest

from tests.helpers import cli as H
from tests.helpers.lm_fixtures import make_data_bin, read_lines

FLAGS = [
    "--tokens-per-sample",
    "32",
    "--max-update",
    "12",
    "--no-epoch-checkpoints",
    "--valid-subset",
    "valid,test",
    "--dropout",
    "0.1",
]


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory, wikitext_dir):
    path = str(tmp_path_factory.mktemp("validate") / "bin")
    make_data_bin(
        path,
        {
            split: read_lines(f"{wikitext_dir}/wiki.{split}.tokens", lines)
            for split, lines in (("train", 300), ("valid", 40), ("test", 40))
        },
    )
    return path


def _validate(data_bin, path):
    run = H.run_cli(
        "toolkit_cli.validate",
        [data_bin, "--path", path, "--valid-subset", "valid,test", "--log-format", "json", "--cpu"],
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.records("valid") + run.records("test")


def _last_valid(run):
    """The training run's last validation of each split (the one of checkpoint_last)."""
    return [run.records("valid")[-1], run.records("test")[-1]]


def test_one_process_valid_line_is_reproduced(data_bin, tmp_path):
    run = H.train(data_bin, str(tmp_path / "ck"), *FLAGS)
    trained = _last_valid(run)
    validated = _validate(data_bin, str(tmp_path / "ck" / "checkpoint_last.pt"))
    assert len(validated) == len(trained) == 2
    for ours, theirs in zip(validated, trained):
        split = "valid" if "valid_loss" in theirs else "test"
        for key in ("loss", "ppl", "wpb", "bsz"):
            assert ours[f"{split}_{key}"] == theirs[f"{split}_{key}"], key


def test_two_rank_sharded_checkpoint_valid_loss_is_reproduced(data_bin, tmp_path):
    run = H.train(
        data_bin,
        str(tmp_path / "ck"),
        *FLAGS,
        "--distributed-world-size",
        "2",
        "--ddp-backend",
        "fully_sharded",
        "--use-sharded-state",
    )
    trained = _last_valid(run)
    validated = _validate(data_bin, str(tmp_path / "ck" / "checkpoint_last"))
    assert len(validated) == len(trained) == 2
    for ours, theirs in zip(validated, trained):
        split = "valid" if "valid_loss" in theirs else "test"
        assert (ours[f"{split}_loss"], ours[f"{split}_ppl"]) == (theirs[f"{split}_loss"], theirs[f"{split}_ppl"])


def test_missing_split_is_one_line(data_bin, tmp_path):
    run = H.train(data_bin, str(tmp_path / "ck"), "--tokens-per-sample", "32", "--max-update", "1")
    bad = H.run_cli(
        "toolkit_cli.validate",
        [data_bin, "--path", str(tmp_path / "ck" / "checkpoint_last.pt"), "--valid-subset", "nosuch"],
    )
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("toolkit-validate: error: ")
    assert run.returncode == 0
