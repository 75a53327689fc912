"""Binarizing with a tokenizer against the tokenizer alone: tokens/s per worker of ``toolkit-preprocess``.

    python -m benchmarks.preprocess_tokenizers                         # 8 MB of WikiText, 1 worker
    python -m benchmarks.preprocess_tokenizers --size-mb 20 --workers 1 2
    python -m benchmarks.preprocess_tokenizers --input jsonl           # the same text as JSON-lines records

For each tokenizer on the same text:

* ``whitespace``: no ``--bpe`` (``str.split``);
* ``gpt2``: ``--bpe gpt2`` with GPT-2-format files (``encoder.json``/``vocab.bpe``) of a byte-level BPE
  of 8k merges trained here on the corpus source (GPT-2's own files need a download);
* ``hf_byte_bpe``: ``--bpe hf_byte_bpe`` with the same kind of model, tokens as pieces;
* ``sentencepiece``: ``--bpe sentencepiece`` with a SentencePiece BPE of 8k pieces trained here on the source.

``alone``: the tokenizer's own batch API on every line in one process (``encode_batch`` in blocks of
lines, as the binarizer calls it; ``sp.encode`` of the same blocks for sentencepiece; ``str.split`` for
whitespace), ``TOKENIZERS_PARALLELISM=false``.
``binarize``: ``toolkit-preprocess --srcdict DICT --validpref CORPUS --workers N`` (the split's
binarize time from its log, start-up excluded), tokens/s per worker and its time over the tokenizer's
time alone (the issue's aim: <= 1.1). ``--input jsonl``: the corpus as JSON-lines records of
``RECORD_LINES`` lines each (documents: one item per record); ``process s`` is then the whole command's wall
time, records read and converted included, and the CPU-seconds table binarizes the records as converted (one
document per item, the conversion not timed) against the tokenizer alone on the same documents. Each row is the
best of ``--repeats`` runs (the machine is shared). ``CPU seconds``: the same split binarized in this process (``binarize_range``, one worker),
through the tokenizer's ids and through its text (``id_pieces`` off), against the tokenizer alone, in CPU
seconds (the three alternated, :func:`benchmarks.timing.alternate`), which a loaded machine disturbs far less than
the wall clock. Prints the tables, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from benchmarks.timing import REPO, Measured, Report, add_results_flag, alternate, cpu_now, now

DEFAULT_SOURCE = os.path.join(REPO, "..", "shared", "data", "wikitext-2-mini", "wiki.train.tokens")
BLOCK_LINES = 8192
RECORD_LINES = 8  # lines of the corpus per JSON-lines record (--input jsonl)


def make_corpus(source: str, dest: str, size_mb: float) -> None:
    data = open(source, "rb").read()
    with open(dest, "wb") as f:
        for _ in range(max(1, -(-int(size_mb * 1e6) // len(data)))):
            f.write(data)


def make_records(corpus: str, dest: str) -> None:
    """The corpus as JSON-lines records of ``RECORD_LINES`` lines each (their newlines inside the text)."""
    with open(corpus, encoding="utf-8") as f, open(dest, "w", encoding="utf-8") as out:
        lines = f.read().split("\n")
        for i in range(0, len(lines), RECORD_LINES):
            out.write(json.dumps({"text": "\n".join(lines[i : i + RECORD_LINES])}) + "\n")


def train_bpe(source: str, folder: str) -> dict:
    """A byte-level BPE saved in GPT-2's file format (vocab.json = encoder.json, merges.txt = vocab.bpe)."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train([source], vocab_size=8192, min_frequency=2, show_progress=False)
    vocab, merges = tok.save_model(folder)
    return {"encoder": vocab, "merges": merges}


def time_alone(name: str, corpus: str, files: dict, clock=now, documents: bool = False) -> tuple:
    """(seconds of ``clock``, tokens) of the tokenizer's own batch API over the corpus lines (``documents``: over
    the documents of a file of NUL-ended documents, ``binarizer.DOCUMENTS``)."""
    with open(corpus, encoding="utf-8", newline="" if documents else None) as f:
        if documents:
            lines = f.read().split("\0")[:-1]
        else:  # hf_byte_bpe reads a line as written, the others strip it (fairseq)
            lines = [line.rstrip("\n") if name == "hf_byte_bpe" else line.strip() for line in f]
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if name == "whitespace":
        t0 = clock()
        tokens = sum(len(line.split()) for line in lines)
        return clock() - t0, tokens
    if name == "sentencepiece":
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=files["sp"])
        tokens = 0
        t0 = clock()
        for i in range(0, len(lines), BLOCK_LINES):
            tokens += sum(map(len, sp.encode(lines[i : i + BLOCK_LINES])))
        return clock() - t0, tokens
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer.from_file(files["encoder"], files["merges"])
    tokens = 0
    t0 = clock()
    for i in range(0, len(lines), BLOCK_LINES):
        tokens += sum(len(e.ids) for e in tok.encode_batch(lines[i : i + BLOCK_LINES]))
    return clock() - t0, tokens


def bpe_flags(name: str, files: dict) -> list:
    if name == "gpt2":
        return ["--bpe", "gpt2", "--gpt2-encoder-json", files["encoder"], "--gpt2-vocab-bpe", files["merges"]]
    if name == "hf_byte_bpe":
        return ["--bpe", "hf_byte_bpe", "--bpe-model", files["hf"]]
    if name == "sentencepiece":
        return ["--bpe", "sentencepiece", "--bpe-model", files["sp"]]
    return []


def preprocess(args: list) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-m", "toolkit_cli.preprocess", "--only-source", "--no-progress-bar", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    if proc.returncode:
        raise SystemExit(f"toolkit-preprocess failed: {proc.stderr[-2000:]}")
    return proc.stdout


def time_binarize(name: str, corpus: str, files: dict, workers: int, tmp: str) -> tuple:
    """(seconds the valid split took to binarize, from the log; wall seconds of the whole command), with the
    data-bin's own dictionary."""
    dict_bin = os.path.join(tmp, f"dict-{name}")
    if not os.path.isdir(dict_bin):
        preprocess(["--trainpref", corpus, "--dict-only", "--destdir", dict_bin, *bpe_flags(name, files)])
    dest = os.path.join(tmp, f"bin-{name}-{workers}")
    shutil.rmtree(dest, ignore_errors=True)  # a fresh data-bin each run (one holding a bpe.json refuses --bpe)
    start = now()
    out = preprocess(
        [
            "--srcdict",
            os.path.join(dict_bin, "dict.txt"),
            "--validpref",
            corpus,
            "--destdir",
            dest,
            "--workers",
            str(workers),
            *bpe_flags(name, files),
        ]
    )
    return float(re.search(r"valid: binarized in ([\d.]+)s", out).group(1)), now() - start


def hf_model(files: dict, folder: str) -> str:
    """The same BPE as an hf_byte_bpe model (tokenizer.json)."""
    from tokenizers import ByteLevelBPETokenizer

    path = os.path.join(folder, "tokenizer.json")
    ByteLevelBPETokenizer.from_file(files["encoder"], files["merges"]).save(path)
    return path


def sentencepiece_model(source: str, folder: str) -> str:
    """A SentencePiece BPE of 8k pieces on the source (the settings of ``--bpe-vocab-size``)."""
    import sentencepiece as spm

    prefix = os.path.join(folder, "sp")
    spm.SentencePieceTrainer.train(
        input=source,
        model_prefix=prefix,
        model_type="bpe",
        vocab_size=8192,
        character_coverage=1.0,
        bos_id=-1,
        eos_id=-1,
        minloglevel=2,
    )
    return prefix + ".model"


def cpu_binarize(name: str, corpus: str, files: dict, tmp: str, by_ids: bool, documents: bool = False) -> float:
    """CPU seconds of ``binarize_range`` over the corpus in this process, with the dictionary of
    ``time_binarize``'s data-bin, through the tokenizer's ids or (``by_ids`` False: ``id_pieces`` off) its
    text: the per-worker cost free of the wall clock's noise on a shared machine. ``documents``: the corpus is
    a file of documents (records as ``toolkit-preprocess`` converts them), one item each."""
    from unittest import mock

    import numpy as np

    from toolkit.data.binarizer import DOCUMENTS, LINES, binarize_range
    from toolkit.data.dictionary import Dictionary
    from toolkit.data.indexed_dataset import MMapIndexedDatasetBuilder, data_file_path, index_file_path
    from toolkit.tokenizers import build_tokenizer

    options = {
        "gpt2": {"gpt2_encoder_json": files["encoder"], "gpt2_vocab_bpe": files["merges"]},
        "hf_byte_bpe": {"bpe_model": files.get("hf")},
        "sentencepiece": {"bpe_model": files.get("sp")},
    }
    tokenizer = build_tokenizer(name, options[name])
    dictionary = Dictionary.load(os.path.join(tmp, f"dict-{name}", "dict.txt"))
    prefix = os.path.join(tmp, f"cpu-{name}")
    builder = MMapIndexedDatasetBuilder(data_file_path(prefix), dtype=np.int32)
    with mock.patch.object(type(tokenizer), "id_pieces", type(tokenizer).id_pieces if by_ids else lambda self: None):
        t0 = cpu_now()
        binarize_range(corpus, 0, None, dictionary, builder, tokenizer, units=DOCUMENTS if documents else LINES)
        seconds = cpu_now() - t0
    builder.finalize(index_file_path(prefix))
    return seconds


def records_as_documents(records: str, tmp: str) -> str:
    """The JSON-lines records as the file of documents ``toolkit-preprocess`` binarizes (``record_inputs``)."""
    from toolkit.data.record_inputs import RecordOptions, write_as_documents

    path = os.path.join(tmp, "corpus.documents")
    write_as_documents("jsonl", records, path, RecordOptions(progress_bars=False), f"--validpref {records}")
    return path


def cpu_rows(names: list, corpus: str, files: dict, tmp: str, repeats: int, documents: bool = False) -> list:
    """CPU seconds, best of ``repeats`` alternated: the tokenizer alone, binarizing through its ids and
    through its text (``documents``: a file of documents, each one item)."""
    print(f"{'CPU seconds':<13}{'alone':>8}{'ids':>8}{'x alone':>9}{'text':>8}{'x alone':>9}")
    rows = []
    for name in names:
        runs = {
            "alone": lambda: Measured(time_alone(name, corpus, files, cpu_now, documents)[0]),
            "ids": lambda: Measured(cpu_binarize(name, corpus, files, tmp, True, documents)),
            "text": lambda: Measured(cpu_binarize(name, corpus, files, tmp, False, documents)),
        }
        best = {k: st.min for k, st in alternate(runs, repeats).items()}
        alone = best["alone"]
        print(
            f"{name:<13}{alone:>8.3f}{best['ids']:>8.3f}{best['ids'] / alone:>9.2f}{best['text']:>8.3f}"
            f"{best['text'] / alone:>9.2f}"
        )
        rows.append(
            {
                "tokenizer": name,
                "cpu_s_alone": round(alone, 3),
                "cpu_s_ids": round(best["ids"], 3),
                "cpu_s_text": round(best["text"], 3),
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=float, default=8.0)
    p.add_argument("--workers", type=int, nargs="+", default=[1])
    p.add_argument("--tokenizers", nargs="+", default=["whitespace", "gpt2", "hf_byte_bpe"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--source", default=DEFAULT_SOURCE)
    p.add_argument("--input", choices=["text", "jsonl"], default="text", help="binarize the text or its records")
    add_results_flag(p)
    args = p.parse_args()
    report = Report("preprocess_tokenizers")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        text = os.path.join(tmp, "corpus.txt")
        make_corpus(args.source, text, args.size_mb)
        corpus = text
        if args.input == "jsonl":
            corpus = os.path.join(tmp, "corpus.jsonl")
            make_records(text, corpus)
        files = train_bpe(args.source, tmp)
        files["hf"] = hf_model(files, tmp)
        if "sentencepiece" in args.tokenizers:
            files["sp"] = sentencepiece_model(args.source, tmp)
        print(f"{os.path.getsize(corpus) / 1e6:.1f} MB of {args.input}, load {os.getloadavg()[0]:.2f}")
        print(
            f"{'tokenizer':<13}{'workers':>8}{'tokens':>12}{'alone tok/s':>14}{'binarize tok/s/worker':>23}"
            f"{'x alone':>9}{'process s':>11}"
        )
        for name in args.tokenizers:
            alone, tokens = min(time_alone(name, text, files) for _ in range(args.repeats))
            for workers in args.workers:
                runs = [time_binarize(name, corpus, files, workers, tmp) for _ in range(args.repeats)]
                seconds, process_s = min(r[0] for r in runs), min(r[1] for r in runs)
                ratio = seconds * workers / alone
                print(
                    f"{name:<13}{workers:>8}{tokens:>12}{tokens / alone:>14,.0f}{tokens / seconds / workers:>23,.0f}"
                    f"{ratio:>9.2f}{process_s:>11.2f}"
                )
                rows.append(
                    {
                        "tokenizer": name,
                        "workers": workers,
                        "tokens": tokens,
                        "alone_tokens_per_s": round(tokens / alone),
                        "binarize_tokens_per_s_per_worker": round(tokens / seconds / workers),
                        "time_over_alone": round(ratio, 3),
                        "process_s": round(process_s, 3),
                    }
                )
        names = [n for n in args.tokenizers if n != "whitespace"]
        if args.input == "text":
            cpu = cpu_rows(names, corpus, files, tmp, args.repeats)
        else:  # the records as converted (conversion not timed), one document per item
            cpu = cpu_rows(names, records_as_documents(corpus, tmp), files, tmp, args.repeats, documents=True)
    report.emit(results=args.results, size_mb=args.size_mb, input=args.input, rows=rows, cpu_rows=cpu)


if __name__ == "__main__":
    main()
