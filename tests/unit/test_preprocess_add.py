"""toolkit-preprocess --srcdict into an existing data-bin adds splits to it, as fairseq-preprocess does
(issue 11 item 7): the new files are those a one-shot run over all splits writes, nothing else changes."""

import json
import os

import pytest

from tests.helpers.preprocess import expect_error, run

SMALL_TRAIN_LINES = 600


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, wikitext_dir):
    """A small train file (the first lines of WikiText's) and the real valid and test files."""
    root = tmp_path_factory.mktemp("corpus")
    with open(os.path.join(wikitext_dir, "wiki.train.tokens"), encoding="utf-8") as f:
        lines = [next(f) for _ in range(SMALL_TRAIN_LINES)]
    train = root / "train.txt"
    train.write_text("".join(lines), encoding="utf-8")
    return str(train), os.path.join(wikitext_dir, "wiki.valid.tokens"), os.path.join(wikitext_dir, "wiki.test.tokens")


@pytest.fixture(scope="module")
def one_shot(tmp_path_factory, corpus):
    """Every split in one run: what the added splits must equal."""
    train, valid, test = corpus
    dest = tmp_path_factory.mktemp("oneshot") / "bin"
    run("--trainpref", train, "--validpref", valid, "--testpref", f"{test},{valid}", "--destdir", dest)
    return dest


def contents(folder):
    return {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder)) if n != "preprocess.log"}


@pytest.fixture
def train_valid(tmp_path, corpus):
    train, valid, _ = corpus
    dest = tmp_path / "bin"
    run("--trainpref", train, "--validpref", valid, "--destdir", dest)
    (dest / "notes.txt").write_text("the user's own file")
    return dest


def test_adds_test_splits_to_a_train_valid_data_bin(train_valid, one_shot, corpus):
    _, valid, test = corpus
    before = contents(train_valid)
    run("--srcdict", train_valid / "dict.txt", "--testpref", f"{test},{valid}", "--destdir", train_valid)
    after = contents(train_valid)
    assert set(after) == set(before) | {"test.bin", "test.idx", "test1.bin", "test1.idx"}
    for name in before:
        assert after[name] == before[name], name  # train, valid, dict.txt and the user's file untouched
    want = contents(one_shot)
    for name in ("test.bin", "test.idx", "test1.bin", "test1.idx"):
        assert after[name] == want[name], name
    log = (train_valid / "preprocess.log").read_text()
    assert log.count("Wrote preprocessed data to") == 2  # appended, as fairseq's FileHandler does
    leftovers = [n for n in os.listdir(train_valid.parent) if n.startswith(".bin.")]
    assert not leftovers, leftovers


def test_existing_split_is_refused_without_overwrite(train_valid, corpus, capsys):
    _, valid, test = corpus
    before = contents(train_valid)
    expect_error(
        capsys,
        ["--srcdict", train_valid / "dict.txt", "--validpref", test, "--destdir", train_valid],
        "--validpref",
        "already has the valid split",
        "--overwrite",
    )
    assert contents(train_valid) == before


def test_overwrite_replaces_only_the_splits_written(train_valid, one_shot, corpus):
    _, valid, test = corpus
    before = contents(train_valid)
    run("--srcdict", train_valid / "dict.txt", "--validpref", test, "--destdir", train_valid, "--overwrite")
    after = contents(train_valid)
    assert set(after) == set(before)
    assert after["valid.bin"] == contents(one_shot)["test.bin"] != before["valid.bin"]
    for name in set(before) - {"valid.bin", "valid.idx"}:
        assert after[name] == before[name], name


def test_a_different_dictionary_is_one_line_naming_both_files(train_valid, tmp_path, corpus, capsys):
    _, valid, test = corpus
    other = tmp_path / "other"
    run("--trainpref", valid, "--destdir", other)
    before = contents(train_valid)
    expect_error(
        capsys,
        ["--srcdict", other / "dict.txt", "--testpref", test, "--destdir", train_valid],
        other / "dict.txt",
        train_valid / "dict.txt",
        "differs",
    )
    expect_error(
        capsys,
        ["--srcdict", train_valid / "dict.txt", "--testpref", test, "--destdir", train_valid, "--bpe", "gpt2"],
        "--bpe",
        "leave out --bpe",
    )
    assert contents(train_valid) == before


def test_without_srcdict_a_data_bin_is_still_refused_with_a_hint(train_valid, corpus, capsys):
    train, _, _ = corpus
    expect_error(
        capsys, ["--trainpref", train, "--destdir", train_valid], "--overwrite", f"--srcdict {train_valid / 'dict.txt'}"
    )


def test_added_split_uses_the_data_bins_tokenizer(tmp_path, corpus):
    train, valid, _ = corpus
    dest = tmp_path / "bpe"
    run("--trainpref", train, "--destdir", dest, "--bpe", "sentencepiece", "--bpe-vocab-size", 300)
    run("--srcdict", dest / "dict.txt", "--validpref", valid, "--destdir", dest)
    model = dest / json.load(open(dest / "bpe.json"))["files"]["bpe_model"]
    reference = tmp_path / "reference"  # the same tokenizer and dictionary, every split in one run
    run(
        "--srcdict",
        dest / "dict.txt",
        "--validpref",
        valid,
        "--destdir",
        reference,
        "--bpe",
        "sentencepiece",
        "--bpe-model",
        model,
    )
    assert (dest / "valid.bin").read_bytes() == (reference / "valid.bin").read_bytes()
    assert (dest / "valid.idx").read_bytes() == (reference / "valid.idx").read_bytes()
