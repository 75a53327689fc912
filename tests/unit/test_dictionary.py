"""dict.txt: fairseq's format ("token count" per line, specials implicit, padded size) and its errors."""

import os
from collections import Counter

import pytest
import torch

from toolkit.data.dictionary import Dictionary
from toolkit.core.errors import UserError


def make_dict(counts, **finalize_kwargs):
    d = Dictionary()
    d.add_counts(Counter(counts))
    d.finalize(**finalize_kwargs)
    return d


def test_specials_are_first_and_implicit(tmp_path):
    d = make_dict({"b": 3, "a": 3, "c": 5})
    assert d.symbols[:4] == ["<s>", "<pad>", "</s>", "<unk>"]
    assert (d.bos(), d.pad(), d.eos(), d.unk()) == (0, 1, 2, 3)
    # by count, ties alphabetically (fairseq's order), then madeupword fillers up to a multiple of 8
    assert d.symbols[4:7] == ["c", "a", "b"]
    assert d.symbols[7] == "madeupword0000" and len(d) == 8
    path = tmp_path / "dict.txt"
    d.save(str(path))
    assert path.read_text(encoding="utf-8") == "c 5\na 3\nb 3\nmadeupword0000 0\n"


def test_round_trip(tmp_path):
    counts = {f"w{i}": 100 - i for i in range(37)}
    counts["héllo"] = 7
    d = make_dict(counts)
    assert len(d) % 8 == 0 and len(d) >= 4 + 38
    path = str(tmp_path / "dict.txt")
    d.save(path)
    loaded = Dictionary.load(path)
    assert loaded == d
    assert loaded.count[4:] == d.count[4:]
    assert loaded.index("héllo") == d.index("héllo") != loaded.unk()
    lines = open(path, encoding="utf-8").read().splitlines()
    assert len(lines) == len(d) - 4
    assert all(len(line.rsplit(" ", 1)) == 2 and line.rsplit(" ", 1)[1].isdigit() for line in lines)
    assert not any(line.split()[0] in ("<s>", "<pad>", "</s>", "<unk>") for line in lines)


@pytest.mark.parametrize("padding_factor,expected", [(1, 7), (8, 8), (16, 16), (3, 9)])
def test_padding_factor(padding_factor, expected):
    d = make_dict({"a": 1, "b": 2, "c": 3}, padding_factor=padding_factor)
    assert len(d) == expected
    assert all(s.startswith("madeupword") for s in d.symbols[7:])
    assert d.symbols[7:] == [f"madeupword{i:04d}" for i in range(expected - 7)]


def test_threshold_and_nwords():
    counts = {"a": 10, "b": 5, "c": 2, "d": 1, "e": 1}
    d = make_dict(counts, threshold=2, padding_factor=1)
    assert d.symbols[4:] == ["a", "b", "c"]
    # nwords counts the 4 specials, as fairseq's --nwordssrc
    d = make_dict(counts, nwords=6, padding_factor=1)
    assert d.symbols[4:] == ["a", "b"]
    d = make_dict(counts, nwords=6, padding_factor=8)
    assert len(d) == 8 and d.symbols[4:6] == ["a", "b"]
    assert d.index("c") == d.unk()


def test_encode_line_appends_eos():
    d = make_dict({"hello": 2, "world": 1})
    ids = d.encode_line("hello  unknown\tworld\n")
    assert ids.dtype == torch.int32
    assert ids.tolist() == [d.index("hello"), d.unk(), d.index("world"), d.eos()]
    assert d.encode_line("").tolist() == [d.eos()]
    assert d.encode_line("   \n").tolist() == [d.eos()]
    assert d.string(ids) == "hello <unk> world"


@pytest.mark.parametrize(
    "content,line",
    [
        ("a 1\nb\n", 2),
        ("a 1\nb 2\nc x\n", 3),
        ("a 1\na 2\n", 2),
        (" 5\n", 1),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, content, line):
    path = tmp_path / "dict.txt"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(UserError) as e:
        Dictionary.load(str(path))
    msg = str(e.value)
    assert str(path) in msg and f"line {line}" in msg
    assert "\n" not in msg


def test_not_text_or_missing(tmp_path):
    path = tmp_path / "dict.bin"
    path.write_bytes(b"\xff\xfe\x00\x01binary")
    with pytest.raises(UserError, match="dict.bin"):
        Dictionary.load(str(path))
    with pytest.raises(UserError, match="not found"):
        Dictionary.load(str(tmp_path / "nope.txt"))


def test_overwrite_flag_and_blank_lines(tmp_path):
    path = tmp_path / "dict.txt"
    path.write_text("a 3\n\nb 2\na 9 #fairseq:overwrite\n", encoding="utf-8")
    d = Dictionary.load(str(path))
    assert "a" in d and "b" in d


def test_preprocess_dict_matches_counts(tmp_path, wikitext_dir):
    """dict.txt written by toolkit-preprocess holds the train split's whitespace-token counts."""
    from toolkit_cli.preprocess import main

    train = os.path.join(wikitext_dir, "wiki.train.tokens")
    dest = tmp_path / "bin"
    main(["--only-source", "--trainpref", train, "--destdir", str(dest), "--dict-only", "--no-progress-bar"])
    counts = Counter()
    with open(train, encoding="utf-8") as f:
        for line in f:
            counts.update(line.split())
    d = Dictionary.load(str(dest / "dict.txt"))
    specials = {"<s>", "<pad>", "</s>", "<unk>"}
    expected = sorted(((w, c) for w, c in counts.items() if w not in specials), key=lambda x: (-x[1], x[0]))
    assert list(zip(d.symbols[4:], d.count[4:]))[: len(expected)] == expected
    assert len(d) % 8 == 0
    assert not (dest / "train.bin").exists()
