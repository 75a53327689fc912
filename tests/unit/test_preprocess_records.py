"""toolkit-preprocess from JSON lines, Parquet and `datasets` folders: the same bytes as the text path."""

import gzip
import json
import logging
import os

import pytest

from tests.helpers.preprocess import files_of as bin_files
from tests.helpers.preprocess import expect_error, run


def real_lines(path, limit):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for _, line in zip(range(limit), f)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, wikitext_dir):
    """2000 real train lines and 300 valid lines as text files, and the text-path data-bin of them."""
    root = tmp_path_factory.mktemp("records")
    train = real_lines(os.path.join(wikitext_dir, "wiki.train.tokens"), 2000)
    valid = real_lines(os.path.join(wikitext_dir, "wiki.valid.tokens"), 300)
    paths = {}
    for name, lines in (("train", train), ("valid", valid)):
        paths[name] = root / f"{name}.txt"
        paths[name].write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    reference = root / "text-bin"
    run("--trainpref", paths["train"], "--validpref", paths["valid"], "--destdir", reference)
    return root, {"train": train, "valid": valid}, bin_files(reference)


def write_jsonl(path, lines, key="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, line in enumerate(lines):
            f.write(json.dumps({"id": i, key: line}) + "\n")


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_jsonl_equals_text(tmp_path, corpus, suffix):
    _, lines, reference = corpus
    paths = {}
    for name in ("train", "valid"):
        paths[name] = tmp_path / f"{name}{suffix}"
        if suffix == ".jsonl.zst":
            zstd = pytest.importorskip("zstandard")
            data = "".join(json.dumps({"body": line}) + "\n" for line in lines[name]).encode()
            paths[name].write_bytes(zstd.ZstdCompressor().compress(data))
        else:
            write_jsonl(paths[name], lines[name], "body", gzip.open if suffix.endswith(".gz") else open)
    dest = tmp_path / "bin"
    run(
        "--trainpref",
        paths["train"],
        "--validpref",
        paths["valid"],
        "--json-key",
        "body",
        "--destdir",
        dest,
        "--workers",
        2,
    )
    assert bin_files(dest) == reference
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".inputs.tmp")], "the extracted text is deleted"


def test_parquet_equals_text(tmp_path, corpus):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    _, lines, reference = corpus
    paths = {}
    for name in ("train", "valid"):
        paths[name] = tmp_path / f"{name}.parquet"
        table = pa.table({"n": list(range(len(lines[name]))), "content": lines[name]})
        pq.write_table(table, paths[name], row_group_size=500)  # several row groups
    dest = tmp_path / "bin"
    run("--trainpref", paths["train"], "--validpref", paths["valid"], "--parquet-column", "content", "--destdir", dest)
    assert bin_files(dest) == reference


@pytest.mark.parametrize("streaming", [False, True])
def test_datasets_folder_equals_text(tmp_path, corpus, streaming):
    datasets = pytest.importorskip("datasets")
    _, lines, reference = corpus
    folder = tmp_path / "ds"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": lines["train"]}),
            "validation": datasets.Dataset.from_dict({"text": lines["valid"]}),
        }
    ).save_to_disk(str(folder))
    dest = tmp_path / "bin"
    run(
        "--hf-dataset",
        folder,
        "--hf-split",
        "train",
        "--hf-valid-split",
        "validation",
        "--destdir",
        dest,
        *(["--streaming"] if streaming else []),
    )
    assert bin_files(dest) == reference


def test_datasets_data_files_folder(tmp_path, corpus):
    """A folder of data files (what load_dataset reads) works too, here JSON lines under train/validation names."""
    pytest.importorskip("datasets")
    _, lines, reference = corpus
    folder = tmp_path / "files"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", lines["train"])
    write_jsonl(folder / "validation.jsonl", lines["valid"])
    dest = tmp_path / "bin"
    os.environ.setdefault("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    run("--hf-dataset", folder, "--hf-valid-split", "validation", "--streaming", "--destdir", dest)
    assert bin_files(dest) == reference


def test_bad_records_counted_one_line_per_kind(tmp_path, caplog):
    path = tmp_path / "mixed.jsonl"
    good = ["first good line", "second good line", "third"]
    raw = [
        json.dumps({"text": good[0]}).encode(),
        b"{not json",
        json.dumps({"other": "x"}).encode(),
        json.dumps({"text": 5}).encode(),
        json.dumps({"text": good[1]}).encode(),
        b'{"text": "caf\xe9"}',  # latin-1 byte: not UTF-8
        json.dumps({"text": None}).encode(),
        json.dumps({"text": "\ud800"}).encode(),  # a lone surrogate escape
        b"",
        json.dumps({"text": good[2]}).encode(),
    ]
    path.write_bytes(b"\n".join(raw) + b"\n")
    text = tmp_path / "good.txt"
    text.write_text("".join(g + "\n" for g in good), encoding="utf-8")
    with caplog.at_level(logging.INFO, logger="toolkit_cli.preprocess"):
        run("--trainpref", path, "--destdir", tmp_path / "a", "--padding-factor", 1)
    run("--trainpref", text, "--destdir", tmp_path / "b", "--padding-factor", 1)
    assert bin_files(tmp_path / "a") == bin_files(tmp_path / "b")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sorted(warnings) == sorted(
        [
            f"--trainpref {path}: 1 record(s) skipped: not a JSON object (first: line 2)",
            f"--trainpref {path}: 1 record(s) skipped: missing key 'text' (first: line 3)",
            f"--trainpref {path}: 2 record(s) skipped: not a string 'text' (first: line 4)",
            f"--trainpref {path}: 2 record(s) skipped: invalid UTF-8 (first: line 6)",
        ]
    ), warnings


def test_parquet_nulls_and_binary(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": pa.array([b"ok one", None, b"\xff\xfe", b"ok two"], pa.binary())}), path)
    text = tmp_path / "t.txt"
    text.write_text("ok one\nok two\n")
    run("--trainpref", path, "--destdir", tmp_path / "a")
    run("--trainpref", text, "--destdir", tmp_path / "b")
    assert bin_files(tmp_path / "a") == bin_files(tmp_path / "b")


# --- bad input: one line, nothing written ------------------------------------------------------
def assert_nothing_left(tmp_path, dest):
    assert not os.path.exists(dest)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], os.listdir(tmp_path)


def test_every_record_bad(tmp_path, capsys):
    path = tmp_path / "x.jsonl"
    write_jsonl(path, ["a", "b"], key="body")
    expect_error(
        capsys, ["--trainpref", path, "--destdir", tmp_path / "out"], "no usable record", "2 missing key", "--json-key"
    )
    assert_nothing_left(tmp_path, tmp_path / "out")


def test_missing_parquet_column(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"body": ["a"]}), path)
    expect_error(
        capsys,
        ["--trainpref", path, "--destdir", tmp_path / "out"],
        "--parquet-column text",
        "has no such column (it has body)",
    )
    assert_nothing_left(tmp_path, tmp_path / "out")


def test_damaged_gzip_and_parquet(tmp_path, capsys):
    gz = tmp_path / "x.jsonl.gz"
    gz.write_bytes(b"not gzip at all")
    expect_error(capsys, ["--trainpref", gz, "--destdir", tmp_path / "out"], str(gz), "check the file")
    pytest.importorskip("pyarrow")
    pqf = tmp_path / "y.parquet"
    pqf.write_bytes(b"PAR1 not really")
    expect_error(capsys, ["--trainpref", pqf, "--destdir", tmp_path / "out"], str(pqf), "not a readable Parquet")
    assert_nothing_left(tmp_path, tmp_path / "out")


def test_hf_dataset_errors(tmp_path, capsys):
    pytest.importorskip("datasets")
    expect_error(
        capsys, ["--hf-dataset", tmp_path / "nope", "--destdir", tmp_path / "out"], "--hf-dataset", "no such folder"
    )
    expect_error(
        capsys,
        ["--hf-dataset", tmp_path / "nope", "--trainpref", "x.txt", "--destdir", tmp_path / "out"],
        "give one of them",
    )
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp_path / "ds"))
    capsys.readouterr()
    expect_error(
        capsys,
        ["--hf-dataset", tmp_path / "ds", "--hf-split", "test", "--destdir", tmp_path / "out"],
        "--hf-split test",
        "no such split (it has train)",
    )
    assert not os.path.exists(tmp_path / "out")


def test_missing_optional_package_is_one_line(tmp_path, capsys, monkeypatch):
    import importlib

    real_import = importlib.import_module

    def no_pyarrow(name, *a):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real_import(name, *a)

    monkeypatch.setattr(importlib, "import_module", no_pyarrow)
    path = tmp_path / "x.parquet"
    path.write_bytes(b"PAR1")
    expect_error(capsys, ["--trainpref", path, "--destdir", tmp_path / "out"], "pip install pyarrow")
    assert_nothing_left(tmp_path, tmp_path / "out")


def test_jsonl_with_a_trained_tokenizer_equals_text(tmp_path, corpus):
    """--bpe works on records as on text: the tokenizer is trained on the same lines."""
    _, lines, _ = corpus
    text = tmp_path / "train.txt"
    text.write_text("".join(line + "\n" for line in lines["train"][:500]), encoding="utf-8")
    write_jsonl(tmp_path / "train.jsonl", lines["train"][:500])
    for name, path in (("a", text), ("b", tmp_path / "train.jsonl")):
        run("--trainpref", path, "--destdir", tmp_path / name, "--bpe", "hf_byte_bpe", "--bpe-vocab-size", 600)
    same = ("dict.txt", "train.bin", "train.idx")
    assert {n: bin_files(tmp_path / "a")[n] for n in same} == {n: bin_files(tmp_path / "b")[n] for n in same}
