"""JSON lines, Parquet and Hugging Face ``datasets`` folders as ``toolkit-preprocess`` inputs.

A record is one document: its text, exactly as stored (newlines, indentation, carriage returns), is
streamed into a file of documents in a private temporary folder, each followed by a NUL character
(``binarizer.DOCUMENTS``; a record holding a NUL is refused, so none is cut). That file then goes through
the one pipeline (workers, dictionary, ``--bpe``, sharding), which makes each document one item: its
newlines encoded as the tokenizer encodes them, one ``</s>`` after it. So the same records give
byte-identical data-bins whichever way they come (JSON lines, Parquet, ``datasets``), and the fast text
pipeline is not written twice. ``--document-separator blank_line`` turns a text file's paragraphs into
such a file too (:func:`write_paragraphs`).

Bad records (not JSON, missing key, not a string, invalid UTF-8, a NUL character) are skipped and counted;
each kind is reported in one warning line naming the first one, and the rest is binarized.
``pyarrow``/``datasets``/``zstandard`` are optional: missing, they are one line naming the
``pip install``.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, Optional

from toolkit.core.errors import UserError, import_optional

logger = logging.getLogger("toolkit_cli.preprocess")

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
HF_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
BATCH_ROWS = 8192
DOCUMENT_END = b"\0"  # binarizer.DOCUMENTS' separator: text holds none

# the kinds of bad records, as reported
NOT_JSON = "not a JSON object"
MISSING_KEY = "missing key"
NOT_STRING = "not a string"
INVALID_UTF8 = "invalid UTF-8"
NUL_CHARACTER = "holds a NUL character"  # "\u0000" escaped in JSON or in a Parquet string: text has none


def input_kind(path: str, hf: bool = False) -> str:
    """``text``, ``jsonl``, ``parquet`` (from the name) or ``hf`` (given as ``--hf-dataset``)."""
    if hf:
        return "hf"
    lower = path.lower()
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def require(module: str, package: str, why: str):
    """Import an optional package, or one UserError naming its pip install."""
    return import_optional(
        module,
        f"{why}: needs the optional package {package}; install it with: "
        f"pip install {package} (or pip install toolkit[data])",
    )


@dataclass
class RecordReport:
    """Records read and written, and the bad ones by kind (with where the first one was)."""

    source: str
    written: int = 0
    bad: Counter = field(default_factory=Counter)
    first_bad: Dict[str, str] = field(default_factory=dict)

    def skip(self, kind: str, where: str) -> None:
        self.bad[kind] += 1
        self.first_bad.setdefault(kind, where)

    def log(self, key_name: str) -> None:
        for kind, n in sorted(self.bad.items()):
            what = f"{kind} {key_name!r}" if kind in (MISSING_KEY, NOT_STRING) else kind
            logger.warning(f"{self.source}: {n} record(s) skipped: {what} (first: {self.first_bad[kind]})")
        logger.info(f"{self.source}: {self.written} records read as text")


@dataclass
class RecordOptions:
    """How to find the text in the records."""

    json_key: str = "text"
    column: str = "text"
    hf_split: str = "train"
    streaming: bool = False
    encoding_errors: str = "strict"
    progress_bars: bool = True


# --- opening ------------------------------------------------------------------------------
def open_binary(path: str):
    """The (decompressed) bytes of a .jsonl, .jsonl.gz or .jsonl.zst file."""
    lower = path.lower()
    if lower.endswith(".gz"):
        return gzip.open(path, "rb")
    if lower.endswith(".zst"):
        zstd = require("zstandard", "zstandard", f"{path}: reading .zst")
        return io.BufferedReader(_ZstdFrames(path, zstd))
    return open(path, "rb")


class _ZstdFrames(io.RawIOBase):
    """A .zst file's bytes, frame after frame, refusing a file cut inside a frame (as gzip refuses a cut
    .gz): zstandard's ``stream_reader`` ends quietly where a truncated file ends, which accepted half the
    records of a file whose copy was interrupted."""

    def __init__(self, path: str, zstd: Any):
        super().__init__()
        self._file, self._zstd, self._frame = open(path, "rb"), zstd, None
        self._out, self._at = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._at == len(self._out):
            chunk = self._file.read(1 << 20)
            if not chunk:
                if self._frame is not None and not self._frame.eof:
                    raise EOFError("the file ends inside a zstd frame: it is truncated")
                return 0
            self._out, self._at = self._decompress(chunk), 0
        n = min(len(buffer), len(self._out) - self._at)
        buffer[:n] = self._out[self._at : self._at + n]
        self._at += n
        return n

    def _decompress(self, chunk: bytes) -> bytes:
        out = []
        while chunk:
            if self._frame is None or self._frame.eof:  # a new frame starts here
                self._frame = self._zstd.ZstdDecompressor().decompressobj()
            out.append(self._frame.decompress(chunk))
            chunk = self._frame.unused_data if self._frame.eof else b""
        return b"".join(out)

    def close(self) -> None:
        self._file.close()
        super().close()


def _decode(data: bytes, errors: str) -> Optional[str]:
    try:
        return data.decode("utf-8", "strict" if errors == "strict" else errors)
    except UnicodeDecodeError:
        return None


def jsonl_texts(path: str, opts: RecordOptions, report: RecordReport) -> Iterator[str]:
    """The text of each good record of a JSON-lines file; blank lines are not records."""
    try:
        with open_binary(path) as f:
            for number, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                line = _decode(raw, opts.encoding_errors)
                if line is None:
                    report.skip(INVALID_UTF8, f"line {number}")
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
                text = _field(record, opts.json_key, report, f"line {number}")
                if text is not None:
                    yield text
    except (OSError, EOFError) as e:  # a damaged .gz/.zst
        raise UserError(f"{path}: cannot be read as {os.path.basename(path)} ({e}); check the file") from None
    except Exception as e:
        if type(e).__module__.startswith("zstandard"):
            raise UserError(f"{path}: not a valid zstd stream ({e}); check the file") from None
        raise


def _field(record: Any, key: str, report: RecordReport, where: str) -> Optional[str]:
    if not isinstance(record, dict):
        report.skip(NOT_JSON, where)
        return None
    if key not in record:
        report.skip(MISSING_KEY, where)
        return None
    value = record[key]
    if not isinstance(value, str):
        report.skip(NOT_STRING, where)
        return None
    return value


def _column_values(values: Iterable[Any], start: int, report: RecordReport, errors: str) -> Iterator[str]:
    """Strings of one Arrow column batch (bytes decoded); None and other types are counted."""
    for row, value in enumerate(values, start):
        if isinstance(value, (bytes, bytearray)):
            value = _decode(bytes(value), errors)
            if value is None:
                report.skip(INVALID_UTF8, f"row {row}")
                continue
        if not isinstance(value, str):
            report.skip(NOT_STRING, f"row {row}")
            continue
        yield value


def parquet_texts(path: str, opts: RecordOptions, report: RecordReport) -> Iterator[str]:
    """The ``--parquet-column`` of a Parquet file, one row group batch at a time."""
    pq = require("pyarrow.parquet", "pyarrow", f"{path}: reading Parquet")
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:
        raise UserError(f"{path}: not a readable Parquet file ({e}); check the file") from None
    names = parquet.schema_arrow.names
    if opts.column not in names:
        raise UserError(
            f"--parquet-column {opts.column}: {path} has no such column (it has {', '.join(names)}); "
            f"give --parquet-column NAME"
        )
    row = 1
    for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=[opts.column]):
        values = batch.column(0).to_pylist()
        yield from _column_values(values, row, report, opts.encoding_errors)
        row += len(values)


def load_hf_split(path: str, opts: RecordOptions):
    """A split of a ``save_to_disk`` folder, or of what ``datasets.load_dataset`` reads from a folder/script."""
    datasets = require("datasets", "datasets", f"--hf-dataset {path}")
    where = f"--hf-dataset {path}"
    if not opts.progress_bars:
        datasets.disable_progress_bars()
    try:
        if any(os.path.isfile(os.path.join(path, m)) for m in HF_MARKERS[1:]):
            loaded = datasets.load_from_disk(path)
            if isinstance(loaded, datasets.DatasetDict):
                if opts.hf_split not in loaded:
                    raise UserError(
                        f"--hf-split {opts.hf_split}: {path} has no such split (it has "
                        f"{', '.join(loaded)}); give --hf-split NAME"
                    )
                loaded = loaded[opts.hf_split]
            return loaded.to_iterable_dataset() if opts.streaming else loaded
        return datasets.load_dataset(path, split=opts.hf_split, streaming=opts.streaming)
    except UserError:
        raise
    except Exception as e:
        message = " ".join(str(e).split())
        raise UserError(
            f"{where}: cannot be loaded with --hf-split {opts.hf_split} ({message}); give a "
            f"save_to_disk folder, a folder of data files or a dataset script"
        ) from None


def hf_texts(path: str, opts: RecordOptions, report: RecordReport) -> Iterator[str]:
    """The ``--parquet-column`` (default ``text``) of a datasets split, in batches."""
    dataset = load_hf_split(path, opts)
    names = dataset.column_names
    if names is not None and opts.column not in names:
        raise UserError(
            f"--parquet-column {opts.column}: the dataset {path} has no such column (it has "
            f"{', '.join(names)}); give --parquet-column NAME"
        )
    row = 1
    for batch in dataset.iter(batch_size=BATCH_ROWS):
        if opts.column not in batch:
            raise UserError(
                f"--parquet-column {opts.column}: the dataset {path} has no such column; give --parquet-column NAME"
            )
        values = batch[opts.column]
        yield from _column_values(values, row, report, opts.encoding_errors)
        row += len(values)


READERS = {"jsonl": jsonl_texts, "parquet": parquet_texts, "hf": hf_texts}


def write_as_documents(kind: str, path: str, out_path: str, opts: RecordOptions, source: str) -> RecordReport:
    """Stream the records of ``path`` into ``out_path`` as documents (each followed by NUL); the report of
    what was skipped."""
    report = RecordReport(source)
    with open(out_path, "wb") as out:
        for text in READERS[kind](path, opts, report):
            if "\0" in text:  # a raw NUL is not JSON (skipped as such); the escaped one would become a word
                report.skip(NUL_CHARACTER, f"record {report.written + sum(report.bad.values()) + 1}")
                continue
            try:
                data = text.encode("utf-8")  # lone surrogates from JSON escapes fail here
            except UnicodeEncodeError:
                report.skip(INVALID_UTF8, f"record {report.written + sum(report.bad.values()) + 1}")
                continue
            out.write(data + DOCUMENT_END)
            report.written += 1
    report.log(opts.json_key if kind == "jsonl" else opts.column)
    if report.written == 0:
        raise UserError(
            f"{source}: no usable record (every record was skipped: "
            f"{', '.join(f'{n} {k}' for k, n in sorted(report.bad.items())) or 'none found'}); "
            f"check --json-key / --parquet-column and the file"
        )
    return report


def write_paragraphs(path: str, out_path: str, encoding_errors: str = "strict") -> int:
    """``--document-separator blank_line``: the paragraphs of the text file ``path`` (runs of lines between
    blank or whitespace-only lines; fairseq's ``complete_doc`` reads documents the same way) into ``out_path``,
    each one document (its lines joined by ``\\n``) followed by NUL. Returns the number of documents."""
    from toolkit.data.binarizer import iter_units

    documents = 0
    with open(out_path, "wb") as out:
        paragraph: list = []
        for line in itertools.chain(iter_units(path, encoding_errors), [""]):
            if line.strip():
                paragraph.append(line)
                continue
            if paragraph:
                out.write("\n".join(paragraph).encode("utf-8") + DOCUMENT_END)
                documents += 1
                paragraph = []
    return documents
