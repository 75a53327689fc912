"""toolkit-preprocess: fairseq-compatible data-bins, worker-count independence, and bad input."""

import os
import re
import stat
from collections import Counter

import numpy as np
import pytest

from tests.helpers.preprocess import expect_error, files_of, run
from toolkit.data import binarizer
from toolkit.data.binarizer import find_offsets, read_blocks
from toolkit.data.dictionary import Dictionary
from toolkit.data.indexed_dataset import MMapIndexedDataset

SPACE_NORMALIZER = re.compile(r"\s+")


def fairseq_tokenize_line(line):
    """fairseq.tokenizer.tokenize_line."""
    return SPACE_NORMALIZER.sub(" ", line).strip().split()


def fairseq_lines(path):
    """Lines as fairseq's Binarizer reads them: a text file, readline() (universal newlines)."""
    with open(path, encoding="utf-8") as f:
        line = f.readline()
        while line:
            yield line
            line = f.readline()


def reference_dict(path, **finalize_kwargs):
    counts = Counter()
    for line in fairseq_lines(path):
        counts.update(fairseq_tokenize_line(line))
    d = Dictionary()
    for w, c in sorted(counts.items()):
        d.add_symbol(w, c)
    d.finalize(**finalize_kwargs)
    return d


def reference_items(path, d):
    return [d.encode_line(line, line_tokenizer=fairseq_tokenize_line).tolist() for line in fairseq_lines(path)]


@pytest.fixture(scope="module")
def wiki_bins(tmp_path_factory, wikitext_dir):
    """The real corpus binarized with 1 and with 2 workers."""
    root = tmp_path_factory.mktemp("wiki")
    train, valid, test = (os.path.join(wikitext_dir, f"wiki.{s}.tokens") for s in ("train", "valid", "test"))
    out = {}
    for workers in (1, 2):
        dest = root / f"w{workers}"
        run(
            "--trainpref",
            train,
            "--validpref",
            f"{valid},{test}",
            "--testpref",
            test,
            "--destdir",
            dest,
            "--workers",
            workers,
        )
        out[workers] = str(dest)
    return out, (train, valid, test)


def test_data_bin_layout(wiki_bins):
    (bins, _) = wiki_bins
    splits = ("train", "valid", "valid1", "test")
    expected = ["dict.txt", "preprocess.log"] + [f"{s}.{e}" for s in splits for e in ("bin", "idx")]
    assert sorted(os.listdir(bins[1])) == sorted(expected)
    mode = stat.S_IMODE(os.stat(bins[1]).st_mode)
    assert mode & 0o055, "the data-bin keeps the usual (umask) permissions, not mkdtemp's 0700"


def test_multi_worker_output_identical(wiki_bins):
    (bins, _) = wiki_bins
    one, two = files_of(bins[1]), files_of(bins[2])
    assert one.keys() == two.keys()
    for name in one:
        assert one[name] == two[name], name


def test_reads_back_as_fairseq_would_encode(wiki_bins):
    (bins, (train, valid, test)) = wiki_bins
    d = Dictionary.load(os.path.join(bins[1], "dict.txt"))
    assert d == reference_dict(train)
    assert len(d) % 8 == 0
    for split, path in (("train", train), ("valid", valid), ("valid1", test), ("test", test)):
        ds = MMapIndexedDataset(os.path.join(bins[1], split))
        assert ds.dtype == np.uint16  # 12k types: the smallest dtype that holds them
        got = [ds[i].tolist() for i in range(len(ds))]
        assert got == reference_items(path, d), split
        assert all(item[-1] == d.eos() for item in got)


def test_log_lines_match_fairseq(wiki_bins):
    (bins, (train, valid, test)) = wiki_bins
    log = open(os.path.join(bins[1], "preprocess.log"), encoding="utf-8").read().splitlines()
    pattern = re.compile(
        r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| INFO \| toolkit_cli\.preprocess \| "
        r"\[None\] (.+): (\d+) sents, (\d+) tokens, (\S+)% replaced \(by <unk>\)$"
    )
    found = [m.groups() for m in map(pattern.match, log) if m]
    assert [f[0] for f in found] == [train, valid, test, test]
    d = Dictionary.load(os.path.join(bins[1], "dict.txt"))
    items = reference_items(valid, d)
    ntok = sum(map(len, items))
    replaced = sum(
        1 for line in fairseq_lines(valid) for w in fairseq_tokenize_line(line) if w not in d.indices and w != "<unk>"
    )
    assert found[1][1:] == (str(len(items)), str(ntok), f"{100 * replaced / ntok:.3}")
    assert any("Wrote preprocessed data to" in line for line in log)


EDGE_TEXT = (
    "hello world\r\n"  # CRLF
    "\n"  # empty line: an item of just </s>
    "   \t \n"  # blank line
    "a\tb  c\rafter-cr\n"  # a lone CR ends a line too (universal newlines)
    "x </s> y\n"  # a literal </s> (the per-line path)
    "<unk> foo <unk> bar\n"  # a literal <unk> is not counted as replaced
    "é ü\u00a0z\u2003w\u3000v\n"  # unicode whitespace splits words, as fairseq's \\s+
    "\x1cq\x1dr\x85s\n"  # separators that are whitespace but not line ends in text files
    + " ".join(f"long{i}" for i in range(150))
    + "\n"  # longer than a block
    + "hello again world\n" * 30
    + "tail without newline"
)


@pytest.fixture
def edge_file(tmp_path):
    path = tmp_path / "edge.txt"
    path.write_bytes(EDGE_TEXT.encode("utf-8"))
    return str(path)


@pytest.mark.parametrize("block_bytes", [64, 1 << 20])
def test_edge_cases_match_fairseq(tmp_path, edge_file, monkeypatch, block_bytes):
    monkeypatch.setattr(binarizer, "BLOCK_BYTES", block_bytes)
    outputs = []
    for workers in (1, 3):
        dest = tmp_path / f"b{workers}"
        run(
            "--trainpref",
            edge_file,
            "--validpref",
            edge_file,
            "--destdir",
            dest,
            "--workers",
            workers,
            "--padding-factor",
            1,
        )
        outputs.append(files_of(dest))
        d = Dictionary.load(str(dest / "dict.txt"))
        assert d == reference_dict(edge_file, padding_factor=1)
        ds = MMapIndexedDataset(str(dest / "train"))
        assert [x.tolist() for x in ds] == reference_items(edge_file, d)
        assert ds.dtype == np.uint8  # fewer than 256 types
    assert outputs[0] == outputs[1]


def test_offsets_and_blocks_cover_file_once(edge_file):
    data = open(edge_file, "rb").read()
    for n in (1, 2, 5, 50):
        offsets = find_offsets(edge_file, n)
        assert offsets[0] == 0 and offsets[-1] == len(data) and offsets == sorted(offsets)
        assert all(o == 0 or o == len(data) or data[o - 1 : o] == b"\n" for o in offsets)
        text = "".join(t for s, e in zip(offsets, offsets[1:]) for t, _ in read_blocks(edge_file, s, e, 50))
        expected = data.decode().replace("\r\n", "\n").replace("\r", "\n") + "\n"
        assert text == expected


def test_srcdict_threshold_nwords(tmp_path, wiki_bins):
    (bins, (train, valid, _)) = wiki_bins
    dest = tmp_path / "srcdict"
    run("--srcdict", os.path.join(bins[1], "dict.txt"), "--validpref", valid, "--destdir", dest)
    assert files_of(dest)["valid.bin"] == files_of(bins[1])["valid.bin"]
    assert (dest / "dict.txt").read_bytes() == open(os.path.join(bins[1], "dict.txt"), "rb").read()
    dest = tmp_path / "small"
    run("--trainpref", train, "--destdir", dest, "--nwordssrc", 100, "--thresholdsrc", 3)
    d = Dictionary.load(str(dest / "dict.txt"))
    assert len(d) == 104 and min(d.count[4:100]) >= 3
    ds = MMapIndexedDataset(str(dest / "train"))
    assert ds.dtype == np.uint8
    # the train ids were written before dict.txt existed and renumbered: same as encoding with it
    expected = reference_items(train, d)
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    replaced = sum(
        1 for line in fairseq_lines(train) for w in fairseq_tokenize_line(line) if w not in d.indices and w != "<unk>"
    )
    ntok = sum(map(len, expected))
    assert f"{replaced / ntok * 100:.3}% replaced" in (dest / "preprocess.log").read_text()


# --- bad input ------------------------------------------------------------------------------
def assert_no_trace(dest):
    assert not os.path.exists(dest)
    parent = os.path.dirname(dest)
    leftovers = [n for n in os.listdir(parent) if n.startswith("." + os.path.basename(dest))]
    assert not leftovers, leftovers


def test_missing_file(tmp_path, capsys, wikitext_dir):
    dest = str(tmp_path / "out")
    missing = tmp_path / "nope.txt"
    expect_error(capsys, ["--trainpref", missing, "--destdir", dest], "--trainpref", missing, "no such file")
    train = os.path.join(wikitext_dir, "wiki.train.tokens")
    expect_error(
        capsys, ["--trainpref", train, "--validpref", f"{train},{missing}", "--destdir", dest], "--validpref", missing
    )
    expect_error(capsys, ["--trainpref", tmp_path, "--destdir", dest], "is a folder")
    assert_no_trace(dest)


def test_unreadable_file(tmp_path, capsys, monkeypatch):
    path = tmp_path / "secret.txt"
    path.write_text("a b\n")
    path.chmod(0)
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # root reads any file: refuse it the way the OS would
        import builtins

        real_open = builtins.open

        def guarded_open(file, *args, **kwargs):
            if str(file) == str(path):
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", guarded_open)
    dest = str(tmp_path / "out")
    expect_error(capsys, ["--trainpref", path, "--destdir", dest], path, "cannot be read", "Permission denied")
    assert_no_trace(dest)


def test_empty_split(tmp_path, capsys, edge_file):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    dest = str(tmp_path / "out")
    expect_error(
        capsys, ["--trainpref", edge_file, "--testpref", empty, "--destdir", dest], "--testpref", empty, "empty"
    )
    assert_no_trace(dest)


@pytest.mark.parametrize("workers", [1, 2])
def test_undecodable_bytes(tmp_path, capsys, edge_file, workers):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"good line\n" * 50 + b"caf\xe9 latin-1\nmore\n")
    dest = str(tmp_path / "out")
    expect_error(
        capsys,
        ["--trainpref", edge_file, "--validpref", bad, "--destdir", dest, "--workers", workers],
        bad,
        "line 51",
        "--encoding-errors replace",
    )
    assert_no_trace(dest)
    # and as the train file (dictionary phase)
    expect_error(capsys, ["--trainpref", bad, "--destdir", dest, "--workers", workers], bad, "line 51")
    assert_no_trace(dest)
    run("--trainpref", bad, "--destdir", dest, "--encoding-errors", "replace", "--workers", workers)
    d = Dictionary.load(os.path.join(dest, "dict.txt"))
    assert "caf\ufffd" in d
    assert len(MMapIndexedDataset(os.path.join(dest, "train"))) == 52


def test_existing_destdir(tmp_path, capsys, edge_file):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    expect_error(capsys, ["--trainpref", edge_file, "--destdir", dest], "--destdir", dest, "--overwrite")
    assert os.listdir(dest) == ["keep.txt"] and (dest / "keep.txt").read_text() == "mine"
    run("--trainpref", edge_file, "--destdir", dest, "--overwrite")
    assert "keep.txt" not in os.listdir(dest) and "train.bin" in os.listdir(dest)
    # an existing empty folder is fine
    empty = tmp_path / "empty"
    empty.mkdir()
    run("--trainpref", edge_file, "--destdir", empty)
    assert "dict.txt" in os.listdir(empty)
    # --overwrite never deletes the input itself
    inside = dest / "corpus.txt"
    inside.write_text("a b c\n")
    expect_error(capsys, ["--trainpref", inside, "--destdir", dest, "--overwrite"], "--destdir", "would delete")
    assert inside.exists()


def test_bad_srcdict(tmp_path, capsys, edge_file):
    bad = tmp_path / "dict.txt"
    bad.write_text("the 5\nnot-a-count-line\n")
    dest = str(tmp_path / "out")
    expect_error(capsys, ["--srcdict", bad, "--validpref", edge_file, "--destdir", dest], bad, "line 2")
    assert_no_trace(dest)
    expect_error(
        capsys,
        ["--srcdict", tmp_path / "none.txt", "--validpref", edge_file, "--destdir", dest],
        "--srcdict",
        "no such",
    )
    assert_no_trace(dest)


def test_bad_flags(tmp_path, capsys, edge_file):
    dest = str(tmp_path / "out")
    expect_error(capsys, ["--trainpref", edge_file, "--destdir", dest, "--workers", 0], "--workers")
    expect_error(capsys, ["--destdir", dest], "--trainpref")
    expect_error(capsys, ["--trainpref", edge_file, "--destdir", dest, "--dataset-impl", "lazy"], "--dataset-impl")
    expect_error(
        capsys, ["--trainpref", edge_file, "--destdir", dest, "--bpe", "sentencepeice"], "--bpe", "sentencepiece"
    )
    expect_error(capsys, ["--trainpref", edge_file, "--destdir", dest, "--bpe", "sentencepiece"], "--bpe-vocab-size")
    assert_no_trace(dest)


def test_on_the_fly_encoding_equals_the_data_bin(tmp_path, edge_file, wikitext_dir):
    """eval-lm on raw text and interactive generation encode with ``TextCodec`` (``Dictionary.encode_line``),
    not with the binarizer's block encoder: both must give the data-bin's ids for every line, including
    unicode whitespace, empty lines, literal ``</s>``/``<unk>`` and words missing from a cut dictionary."""
    from toolkit.evaluation.text import TextCodec

    valid = os.path.join(wikitext_dir, "wiki.valid.tokens")
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(open(valid, "rb").read()[:200_000] + EDGE_TEXT.encode("utf-8"))
    dest = tmp_path / "bin"
    run("--trainpref", corpus, "--validpref", corpus, "--destdir", dest, "--thresholdsrc", 2)
    d = Dictionary.load(str(dest / "dict.txt"))
    codec = TextCodec(d, str(dest), add_bos_token=False)
    assert codec.kind == "whitespace"
    lines = [line.rstrip("\n") for line in fairseq_lines(str(corpus))]
    on_the_fly = [codec.encode(line) + [d.eos()] for line in lines]
    assert d.unk() in {i for item in on_the_fly for i in item}  # the threshold left words out
    for split in ("train", "valid"):
        ds = MMapIndexedDataset(str(dest / split))
        assert [ds[i].tolist() for i in range(len(ds))] == on_the_fly, split
