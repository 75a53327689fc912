"""toolkit-preprocess --num-shards/--shard-id parts joined by --merge: the bytes of one run."""

import os

import pytest

from tests.helpers.preprocess import files_of as bin_files
from tests.helpers.preprocess import expect_error, run


@pytest.fixture(scope="module")
def one_run(tmp_path_factory, wikitext_dir):
    root = tmp_path_factory.mktemp("shards")
    train, valid, test = (os.path.join(wikitext_dir, f"wiki.{s}.tokens") for s in ("train", "valid", "test"))
    run("--trainpref", train, "--validpref", valid, "--testpref", test, "--destdir", root / "one")
    return root, (train, valid, test)


@pytest.mark.parametrize("num_shards", [2, 5])
def test_parts_merged_equal_one_run(one_run, num_shards):
    root, (train, valid, test) = one_run
    parts = root / f"parts{num_shards}"
    for shard in range(num_shards):
        run(
            "--trainpref",
            train,
            "--validpref",
            valid,
            "--testpref",
            test,
            "--srcdict",
            root / "one" / "dict.txt",
            "--num-shards",
            num_shards,
            "--shard-id",
            shard,
            "--destdir",
            parts / str(shard),
            "--workers",
            1 + shard % 2,
        )
    assert bin_files(parts / "0") != bin_files(root / "one")  # a part alone is not the whole
    run("--merge", f"{parts}/*", "--destdir", root / f"merged{num_shards}")
    assert bin_files(root / f"merged{num_shards}") == bin_files(root / "one")


def test_dict_only_then_parts(tmp_path, wikitext_dir):
    """The documented workflow: the dictionary once (--dict-only), the parts, the merge."""
    valid = os.path.join(wikitext_dir, "wiki.valid.tokens")
    run("--trainpref", valid, "--destdir", tmp_path / "one")
    run("--trainpref", valid, "--dict-only", "--destdir", tmp_path / "dict")
    for shard in range(3):
        run(
            "--trainpref",
            valid,
            "--srcdict",
            tmp_path / "dict" / "dict.txt",
            "--num-shards",
            3,
            "--shard-id",
            shard,
            "--destdir",
            tmp_path / "parts" / f"p{shard}",
        )
    run("--merge", ",".join(str(tmp_path / "parts" / f"p{i}") for i in range(3)), "--destdir", tmp_path / "all")
    assert bin_files(tmp_path / "all") == bin_files(tmp_path / "one")


def test_bad_shard_flags_and_merges(tmp_path, capsys, wikitext_dir):
    valid = os.path.join(wikitext_dir, "wiki.valid.tokens")
    expect_error(capsys, ["--trainpref", valid, "--num-shards", 2, "--destdir", tmp_path / "x"], "--srcdict")
    expect_error(
        capsys,
        ["--trainpref", valid, "--num-shards", 2, "--shard-id", 2, "--destdir", tmp_path / "x"],
        "--shard-id 2: must be in [0, --num-shards 2)",
    )
    run("--trainpref", valid, "--dict-only", "--destdir", tmp_path / "dict")
    for shard in (0, 2):
        run(
            "--trainpref",
            valid,
            "--srcdict",
            tmp_path / "dict" / "dict.txt",
            "--num-shards",
            3,
            "--shard-id",
            shard,
            "--destdir",
            tmp_path / "parts" / str(shard),
        )
    expect_error(capsys, ["--merge", f"{tmp_path}/parts/*", "--destdir", tmp_path / "m"], "parts 1 of 3 are missing")
    expect_error(capsys, ["--merge", f"{tmp_path}/nothing/*", "--destdir", tmp_path / "m"], "names no part folder")
    expect_error(capsys, ["--merge", str(tmp_path / "dict"), "--destdir", tmp_path / "m"], "has no shard.json")
    run(
        "--trainpref",
        valid,
        "--srcdict",
        tmp_path / "dict" / "dict.txt",
        "--num-shards",
        3,
        "--shard-id",
        1,
        "--destdir",
        tmp_path / "parts" / "1",
        "--padding-factor",
        1,
    )
    with open(tmp_path / "parts" / "1" / "dict.txt", "a") as f:
        f.write("extra 1\n")
    expect_error(capsys, ["--merge", f"{tmp_path}/parts/*", "--destdir", tmp_path / "m"], "differs from")
    assert not os.path.exists(tmp_path / "m")
