"""--bpe sentencepiece / hf_byte_bpe / gpt2: trained or loaded, recorded in the data-bin, reversible."""

import json
import math
import os
import re
import unicodedata

import pytest

from toolkit.data.dictionary import Dictionary
from toolkit.data.indexed_dataset import MMapIndexedDataset
from toolkit.core.errors import UserError
from toolkit.config.options import parse_with_components
from toolkit.core.registry import TOKENIZER_REGISTRY
from toolkit.tokenizers import build_tokenizer, load_tokenizer_for_data_bin, tokenizer_names
from toolkit_cli.preprocess import cli_main, main


def run(*argv):
    return main(["--only-source", "--no-progress-bar", *map(str, argv)])


def corpus_files(name, wikitext_dir, shakespeare_file):
    if name == "wikitext":
        return os.path.join(wikitext_dir, "wiki.train.tokens"), os.path.join(wikitext_dir, "wiki.valid.tokens")
    return shakespeare_file, None


def decoded_items(dest, split="train"):
    tok = load_tokenizer_for_data_bin(str(dest))
    d = Dictionary.load(os.path.join(dest, "dict.txt"))
    ds = MMapIndexedDataset(os.path.join(dest, split))
    return tok, d, [tok.decode(d.string(ds[i])) for i in range(len(ds))]


def lines_of(path):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def test_registered_and_options():
    assert {"sentencepiece", "hf_byte_bpe", "gpt2"} <= set(tokenizer_names())
    args = parse_with_components(
        "toolkit-preprocess",
        [],
        ["--bpe", "gpt2", "--gpt2-encoder-json", "e.json", "--gpt2-vocab-bpe", "v.bpe"],
        selectors=(TOKENIZER_REGISTRY,),
        arch=False,
    )
    assert (args.gpt2_encoder_json, args.gpt2_vocab_bpe) == ("e.json", "v.bpe")
    args = parse_with_components(
        "toolkit-preprocess",
        [],
        ["--bpe", "sentencepiece", "--sentencepiece-model", "m"],
        selectors=(TOKENIZER_REGISTRY,),
        arch=False,
    )
    assert args.bpe_model == "m"


@pytest.mark.parametrize("corpus", ["wikitext", "shakespeare"])
@pytest.mark.parametrize("bpe", ["sentencepiece", "hf_byte_bpe"])
def test_trained_tokenizer(tmp_path, wikitext_dir, shakespeare_file, corpus, bpe):
    train, valid = corpus_files(corpus, wikitext_dir, shakespeare_file)
    dest = tmp_path / "bin"
    vocab_size = 800 if corpus == "wikitext" else 500
    argv = [
        "--trainpref",
        train,
        "--destdir",
        dest,
        "--bpe",
        bpe,
        "--bpe-vocab-size",
        vocab_size,
        "--workers",
        2 if corpus == "wikitext" else 1,
    ]
    if valid:
        argv += ["--validpref", valid]
    result = run(*argv)
    record = json.load(open(dest / "bpe.json"))
    model_file = record["files"]["bpe_model"]
    assert record["bpe"] == bpe and (dest / model_file).is_file()
    assert record["source"]["bpe_model"].startswith("trained on ")
    assert result.summaries["train"].num_replaced == 0  # every piece of the train split is in dict.txt
    assert len(Dictionary.load(str(dest / "dict.txt"))) <= vocab_size + 8

    tok, d, decoded = decoded_items(dest)
    originals = lines_of(train)
    assert len(decoded) == len(originals)
    if bpe == "hf_byte_bpe":  # byte-level, text as written: exact, a line's leading and trailing spaces included
        assert decoded == originals
    else:  # SentencePiece normalizes (NFKC) and collapses whitespace
        expected = [unicodedata.normalize("NFKC", " ".join(line.split())) for line in originals]
        assert sum(a == b for a, b in zip(decoded, expected)) >= 0.99 * len(expected)
    assert tok.encode(originals[1]) == tok.encode_lines([originals[1]])[0]

    # the saved model, given back with --bpe-model (and 1 worker), reproduces the data-bin
    again = tmp_path / "again"
    argv = ["--trainpref", train, "--destdir", again, "--bpe", bpe, "--bpe-model", dest / model_file]
    if valid:
        argv += ["--validpref", valid]
    run(*argv)
    for name in os.listdir(dest):
        if name not in ("preprocess.log", "bpe.json"):
            assert (again / name).read_bytes() == (dest / name).read_bytes(), name
    assert json.load(open(again / "bpe.json"))["source"]["bpe_model"] == str(dest / model_file)


# --- gpt2 ------------------------------------------------------------------------------------
def gpt2_byte_map():
    """GPT-2's byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class ReferenceGpt2:
    """A plain-Python GPT-2 BPE encoder (OpenAI's algorithm) to check the tokenizers-based one."""

    PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

    def __init__(self, encoder_json, vocab_bpe):
        regex = pytest.importorskip("regex")
        self.pattern = regex.compile(self.PATTERN)
        self.encoder = json.load(open(encoder_json, encoding="utf-8"))
        merges = open(vocab_bpe, encoding="utf-8").read().split("\n")[1:]
        self.ranks = {tuple(m.split()): i for i, m in enumerate(m for m in merges if m)}
        self.bytes = gpt2_byte_map()

    def bpe(self, word):
        parts = list(word)
        while len(parts) > 1:
            rank, pair = min((self.ranks.get(p, math.inf), p) for p in zip(parts, parts[1:]))
            if rank == math.inf:
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def encode(self, text):
        ids = []
        for piece in self.pattern.findall(text):
            word = "".join(self.bytes[b] for b in piece.encode("utf-8"))
            ids += [self.encoder[p] for p in self.bpe(word)]
        return ids


def make_gpt2_files(folder, train_file, vocab_size):
    """A tiny encoder.json + vocab.bpe in GPT-2's format, from a byte-level BPE trained here."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        (line.strip() for line in lines_of(train_file)),
        vocab_size=vocab_size,
        show_progress=False,
        special_tokens=["<|endoftext|>"],
    )
    folder.mkdir(exist_ok=True)
    vocab, merges = tok.save_model(str(folder))
    os.replace(vocab, folder / "encoder.json")
    os.replace(merges, folder / "vocab.bpe")
    assert (folder / "vocab.bpe").read_text(encoding="utf-8").startswith("#version")
    return folder / "encoder.json", folder / "vocab.bpe"


@pytest.mark.parametrize("corpus", ["wikitext", "shakespeare"])
def test_gpt2(tmp_path, wikitext_dir, shakespeare_file, corpus):
    train, valid = corpus_files(corpus, wikitext_dir, shakespeare_file)
    encoder_json, vocab_bpe = make_gpt2_files(tmp_path / "gpt2", train, 700)
    dest = tmp_path / "bin"
    argv = [
        "--trainpref",
        train,
        "--destdir",
        dest,
        "--bpe",
        "gpt2",
        "--gpt2-encoder-json",
        encoder_json,
        "--gpt2-vocab-bpe",
        vocab_bpe,
    ]
    if valid:
        argv += ["--validpref", valid]
    run(*argv)
    assert (dest / "encoder.json").read_bytes() == encoder_json.read_bytes()
    assert (dest / "vocab.bpe").read_bytes() == vocab_bpe.read_bytes()
    d = Dictionary.load(str(dest / "dict.txt"))
    # fairseq's convention: the dictionary's tokens are GPT-2 ids written as strings
    assert all(s.isdigit() or s.startswith("madeupword") for s in d.symbols[4:])

    tok, _, decoded = decoded_items(dest)
    originals = lines_of(train)
    assert decoded == [line.strip() for line in originals]

    reference = ReferenceGpt2(encoder_json, vocab_bpe)
    sample = [line.strip() for line in originals[:400]] + ["Hello,  world! It's 2024 — naïve café ✓"]
    for line in sample:
        assert tok.encode(line) == " ".join(map(str, reference.encode(line))), line
    assert tok.decode("<unk> " + tok.encode("hi there")) == "<unk>hi there"


def test_whitespace_data_bin_has_no_tokenizer(tmp_path, shakespeare_file):
    run("--trainpref", shakespeare_file, "--destdir", tmp_path / "ws", "--dict-only")
    assert load_tokenizer_for_data_bin(str(tmp_path / "ws")) is None


# --- bad input ---------------------------------------------------------------------------------
def expect_error(capsys, argv, *fragments):
    with pytest.raises(SystemExit) as e:
        cli_main(["--only-source", "--no-progress-bar", *map(str, argv)])
    assert e.value.code == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("toolkit-preprocess: error: "), lines
    for fragment in fragments:
        assert str(fragment) in lines[0], (fragment, lines)


def test_bad_tokenizer_options(tmp_path, capsys, shakespeare_file):
    dest = tmp_path / "out"
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("a b c\nb c d\n")
    expect_error(
        capsys,
        ["--trainpref", tiny, "--destdir", dest, "--bpe", "sentencepiece", "--bpe-vocab-size", 5000],
        "--bpe-vocab-size 5000",
        "too high",
    )
    expect_error(
        capsys,
        ["--trainpref", tiny, "--destdir", dest, "--bpe", "hf_byte_bpe", "--bpe-vocab-size", 100],
        "--bpe-vocab-size 100",
        "256",
    )
    expect_error(capsys, ["--trainpref", tiny, "--destdir", dest, "--bpe", "gpt2"], "--gpt2-encoder-json")
    not_json = tmp_path / "encoder.json"
    not_json.write_text("this is not json")
    expect_error(
        capsys,
        [
            "--trainpref",
            tiny,
            "--destdir",
            dest,
            "--bpe",
            "gpt2",
            "--gpt2-encoder-json",
            not_json,
            "--gpt2-vocab-bpe",
            tiny,
        ],
        "--gpt2-encoder-json",
        not_json,
    )
    expect_error(
        capsys,
        ["--trainpref", tiny, "--destdir", dest, "--bpe", "sentencepiece", "--bpe-model", tiny],
        "--bpe-model",
        tiny,
    )
    expect_error(
        capsys,
        ["--trainpref", tiny, "--destdir", dest, "--bpe", "hf_byte_bpe", "--bpe-model", tmp_path / "missing.json"],
        "--bpe-model",
        "no such file",
    )
    assert not dest.exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".out")]


def test_build_tokenizer_errors(tmp_path):
    with pytest.raises(UserError, match="--bpe"):
        build_tokenizer("no_such_bpe")
    with pytest.raises(UserError, match="--bpe-model"):
        build_tokenizer("sentencepiece", {})
    (tmp_path / "bpe.json").write_text("{not json")
    with pytest.raises(UserError, match="bpe.json"):
        load_tokenizer_for_data_bin(str(tmp_path))


def make_hf_byte_bpe(path, train_file, vocab_size):
    """A tokenizer.json (byte-level BPE) whose vocabulary holds ``<unk>`` and ``</s>`` as added tokens."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        (line.strip() for line in lines_of(train_file)),
        vocab_size=vocab_size,
        show_progress=False,
        special_tokens=["<unk>", "</s>"],
    )
    tok.save(str(path))
    return path


def make_sentencepiece_model(path, train_file, vocab_size, byte_fallback):
    """A SentencePiece BPE of the train file's characters (so CJK, emoji and the like are outside it)."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=(l.strip() for l in lines_of(train_file) if l.strip()),
        model_prefix=str(path),
        model_type="bpe",
        vocab_size=vocab_size,
        bos_id=-1,
        eos_id=-1,
        byte_fallback=byte_fallback,
        minloglevel=2,
    )
    return f"{path}.model"


# characters outside a model trained on Shakespeare, each kind alone and in runs: sentencepiece writes them
# as themselves (its ids give the unk id); "\x85" and "\u2028" are whitespace to str.split
OUTSIDE = "你好世界 ok 🙂🚀x ǅ ᚠᛇᚻ \u0416\u0436 a\x85b \u2028 ☃ 𝔘𝔫𝔦 한국어 \u200b z\n"


@pytest.mark.parametrize("cut", [[], ["--thresholdsrc", 20]], ids=["whole", "threshold"])
@pytest.mark.parametrize("bpe", ["gpt2", "hf_byte_bpe", "sentencepiece", "sentencepiece_bytes"])
def test_id_path_equals_text_path(tmp_path, monkeypatch, wikitext_dir, shakespeare_file, bpe, cut):
    """With a tokenizer that has ``id_pieces`` the binarizer maps its ids through arrays (the train split's
    provisional ids are the tokenizer's ids; other splits look them up in a table; lines holding an id
    without a fixed piece, sentencepiece's unk id, take the text path): dict.txt, every split's bytes and
    the replaced counts must be those of the text path (pieces joined, split, looked up)."""
    edge = "\n\n  \u00a0 \n a <unk> b </s> c \u2003 d\n\x1cq\x85r\n"  # empty/blank lines, specials, unicode spaces
    # the train split repeats the unknown characters so that, with the threshold, some of them make dict.txt
    train, valid = tmp_path / "train.txt", tmp_path / "valid.txt"
    train.write_text(open(shakespeare_file, encoding="utf-8").read()[:300_000] + edge + OUTSIDE * 25, encoding="utf-8")
    valid.write_text(
        open(os.path.join(wikitext_dir, "wiki.valid.tokens"), encoding="utf-8").read()[:150_000]
        + edge
        + OUTSIDE
        + "天地 🎉 ✈ a\u0300\n",
        encoding="utf-8",
    )
    if bpe == "gpt2":
        encoder_json, vocab_bpe = make_gpt2_files(tmp_path / "gpt2", shakespeare_file, 700)
        flags = ["--bpe", "gpt2", "--gpt2-encoder-json", encoder_json, "--gpt2-vocab-bpe", vocab_bpe]
    elif bpe == "hf_byte_bpe":
        flags = ["--bpe", "hf_byte_bpe", "--bpe-model", make_hf_byte_bpe(tmp_path / "tok.json", shakespeare_file, 700)]
    else:
        model = make_sentencepiece_model(tmp_path / "sp", shakespeare_file, 700, bpe == "sentencepiece_bytes")
        flags = ["--bpe", "sentencepiece", "--bpe-model", model]
    bpe_name = flags[1]
    outputs = {}
    for path in ("ids", "text"):
        if path == "text":
            monkeypatch.setattr(TOKENIZER_REGISTRY.get(bpe_name).cls, "id_pieces", lambda self: None)
        dest = tmp_path / path
        run("--trainpref", train, "--validpref", valid, "--destdir", dest, "--workers", 2, *cut, *flags)
        log = (dest / "preprocess.log").read_text(encoding="utf-8")
        outputs[path] = {
            name: (dest / name).read_bytes()
            for name in ("dict.txt", "train.bin", "train.idx", "valid.bin", "valid.idx")
        }
        outputs[path]["replaced"] = re.findall(r"\d+ sents, \d+ tokens, \S+% replaced", log)
    assert outputs["ids"] == outputs["text"]
    if bpe == "sentencepiece":  # lines with the unk id went through: the unknown characters' own text is a word
        assert "你好世界" in outputs["ids"]["dict.txt"].decode("utf-8")
    # <unk> is exercised: pieces cut by the threshold, and pieces of the valid split never seen in train
    assert not outputs["ids"]["replaced"][1].endswith(" 0.0% replaced")


def test_sentencepiece_takes_one_thread_in_a_binarizer_worker(tmp_path, monkeypatch, shakespeare_file):
    """A binarizer worker (TOKENIZERS_PARALLELISM=false, set by its pool's initializer) encodes on one thread,
    elsewhere on every core; the pieces and ids are the same either way."""
    tok = build_tokenizer(
        "sentencepiece", {"bpe_model": make_sentencepiece_model(tmp_path / "sp", shakespeare_file, 300, False)}
    )
    lines = ["First Citizen: before we proceed", OUTSIDE.strip()]
    seen = []
    encode = tok.sp.encode

    def recording(*args, **kwargs):
        seen.append(kwargs.get("num_threads"))
        return encode(*args, **kwargs)

    monkeypatch.setattr(tok.sp, "encode", recording)
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    everywhere = (tok.encode_lines(lines), tok.encode_lines_to_ids(lines))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    assert (tok.encode_lines(lines), tok.encode_lines_to_ids(lines)) == everywhere
    assert seen == [-1, -1, 1, 1]
