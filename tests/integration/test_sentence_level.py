"""Sentence-level training (--sample-break-mode eos|complete|complete_doc): long lines are skipped with
fairseq's warning, and fairseq's --shorten-method truncate|random_crop cut them instead."""

import os
import re

import numpy as np
import pytest

from tests.helpers.lm_fixtures import make_data_bin
from tests.helpers.cli import train


def long_line_corpus():
    """Real-looking lines, some longer than 32 tokens; documents separated by empty lines."""
    words = (
        "the cat sat on a mat while dogs ran in the park and birds sang over tall green trees near an old river bank"
    ).split()
    rng = np.random.RandomState(1)
    lines = []
    for k in range(240):
        n = int(rng.choice([5, 12, 20, 45, 80])) if k % 9 else 0
        lines.append(" ".join(rng.choice(words, size=n)))
    return lines


@pytest.fixture(scope="module")
def long_lines_bin(tmp_path_factory):
    root = tmp_path_factory.mktemp("sentences")
    lines = long_line_corpus()
    make_data_bin(root / "bin", {"train": lines, "valid": lines[:60]})
    return str(root / "bin"), lines


def skipped_in_log(stdout):
    found = re.findall(
        r"WARNING \| [\w.]+ \| ([\d,]+) samples have invalid sizes and will be skipped, "
        r"max_positions=(\d+), first few sample ids=\[",
        stdout,
    )
    return [(int(n.replace(",", "")), int(m)) for n, m in found]


@pytest.mark.parametrize("mode", ["eos", "complete", "complete_doc"])
def test_long_lines_skipped_with_fairseqs_warning(tmp_path, long_lines_bin, mode):
    data, lines = long_lines_bin
    run = train(
        data,
        str(tmp_path / "ckpt"),
        "--sample-break-mode",
        mode,
        "--max-update",
        "4",
        "--skip-invalid-size-inputs-valid-test",
        "--no-save",
    )
    too_long = sum(len(line.split()) + 1 > 32 for line in lines)
    if mode == "complete_doc":
        too_long = sum(len(line.split()) + 1 > 32 for line in lines if line)
    skipped = skipped_in_log(run.stdout)
    assert skipped and skipped[0] == (too_long, 32), (skipped, too_long)
    assert run.losses() and all(np.isfinite(v) for v in run.losses().values())


def test_shorten_truncate_keeps_every_line(tmp_path, long_lines_bin):
    data, lines = long_lines_bin
    run = train(
        data,
        str(tmp_path / "ckpt"),
        "--sample-break-mode",
        "eos",
        "--max-update",
        "3",
        "--shorten-method",
        "truncate",
        "--no-save",
    )
    assert not skipped_in_log(run.stdout), "truncated lines fit: nothing is skipped"
    cut = sum(len(line.split()) + 1 > 32 for line in lines)
    assert f"--shorten-method truncate: {cut} of {len(lines)} train lines cut to 32 tokens" in run.stdout


def test_shorten_split_list_and_random_crop(tmp_path, long_lines_bin):
    """Only train is cropped: valid still holds long lines, skipped under --skip-invalid-size-inputs-valid-test."""
    data, lines = long_lines_bin
    run = train(
        data,
        str(tmp_path / "ckpt"),
        "--sample-break-mode",
        "eos",
        "--max-update",
        "3",
        "--shorten-method",
        "random_crop",
        "--shorten-data-split-list",
        "train",
        "--skip-invalid-size-inputs-valid-test",
        "--no-save",
    )
    valid_long = sum(len(line.split()) + 1 > 32 for line in lines[:60])
    assert skipped_in_log(run.stdout) == [(valid_long, 32)]
    assert "--shorten-method random_crop:" in run.stdout and " valid lines cut" not in run.stdout


def test_every_sample_too_long_is_one_line(tmp_path):
    make_data_bin(tmp_path / "bin", {"train": ["a b c d e f g h i j"] * 8, "valid": ["a b"]})
    run = train(
        str(tmp_path / "bin"),
        str(tmp_path / "ckpt"),
        "--sample-break-mode",
        "eos",
        "--tokens-per-sample",
        "4",
        "--max-update",
        "2",
        "--no-save",
        check=False,
    )
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    err = run.stderr.strip().splitlines()
    assert len(err) == 1 and "every sample is skipped" in err[0] and "--shorten-method truncate" in err[0], err
    assert not os.path.exists(tmp_path / "ckpt" / "checkpoint_last.pt")
