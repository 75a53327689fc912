"""Text -> token ids, streamed in byte blocks and spread over worker processes.

A file is cut into line-aligned byte ranges (one per worker, as fairseq's
``find_offsets``); each range is read in blocks of complete lines
(``BLOCK_BYTES``), so memory stays bounded whatever the file size. Per block the
hot loop is one ``str.split`` and one C-level dict lookup per token: every
``\n`` becomes `` </s> `` so one ``split`` gives the tokens of all lines with
their end-of-sentence markers (fairseq's ``append_eos=True``), the ids go to the
dataset builder as one array, and the item sizes come from the positions of
``</s>``. Blocks holding a literal ``</s>`` take a per-line path instead.

* train split (dictionary built here): ONE pass counts and binarizes. Ids are
  handed out in order of first appearance (``ProvisionalEncoder``), the counts
  are ``np.bincount`` of them, and each worker writes its range as an int32
  part. Once ``dict.txt`` is finalized the parts are renumbered with one array
  lookup per chunk while they are merged in order (``finish_provisional``).
* other splits, or a given ``--srcdict``: the dictionary is known, so the ids
  are final at once (``binarize_file``); workers write ``{prefix}.pt{i}`` parts
  merged in order with ``MMapIndexedDatasetBuilder.merge_file_``.

With a tokenizer whose ids stand for fixed one-word pieces (``Tokenizer.id_pieces``: ``gpt2``,
``hf_byte_bpe``, ``sentencepiece``) no piece text is made: its ids are the provisional ids
(``ProvisionalIdEncoder``), or go through one table to the final ids (``TokenizerIdEncoder``); only a line
holding an id whose text varies (sentencepiece's unk id) takes the text path; the output is that of the
text path.

Either way the output does not depend on the number of workers. Lines are
split as Python's text files do (``\n``, ``\r\n`` and ``\r``), a line is
tokenized with ``str.split()`` (fairseq's ``tokenize_line``), and an empty line
is an item holding only ``</s>``, as in fairseq.

A file of documents (``DOCUMENTS``: records of JSON lines, Parquet or ``datasets``, or the paragraphs of
``--document-separator blank_line``) holds each document followed by a NUL character, which text never
holds: the same pipeline cuts it at NULs instead of newlines, and each document is one item, its newlines
encoded as the tokenizer encodes them (``Tokenizer.encode_documents``: a Hugging Face tokenizer gives
``AutoTokenizer``'s ids, its special tokens included; whitespace tokens drop them, as fairseq's
``tokenize_line``), then ``</s>`` (unless the tokenizer's own template already ends the text with it).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import signal
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from toolkit.data.indexed_dataset import MMapIndexedDatasetBuilder, data_file_path, index_file_path
from toolkit.core.errors import UserError

BLOCK_BYTES = 2 << 20  # bytes of text handled per step: ~400k tokens, a few tens of MB of Python objects

Progress = Optional[Callable[[int], Any]]
TokenizerSpec = Optional[Tuple[str, Dict[str, Any]]]  # (registered --bpe name, its options as a dict)


@dataclass(frozen=True)
class Units:
    """What one item of a file is: a line (text files, fairseq's), or a document ended by ``separator``."""

    separator: str
    documents: bool

    def split(self, text: str) -> List[str]:
        """The units of a block (each ends with the separator)."""
        units = text.split(self.separator)
        units.pop()
        return units

    def pieces(self, tokenizer, units: List[str]) -> List[str]:
        return tokenizer.encode_documents(units) if self.documents else tokenizer.encode_lines(units)

    def ids(self, tokenizer, units: List[str]) -> List[List[int]]:
        return tokenizer.encode_documents_to_ids(units) if self.documents else tokenizer.encode_lines_to_ids(units)


LINES = Units("\n", documents=False)
DOCUMENTS = Units("\0", documents=True)  # NUL ends each document: no text holds one


@dataclass
class BinarizeSummary:
    """Items, tokens (``</s>`` included) and tokens replaced by ``<unk>`` of one split."""

    num_seq: int = 0
    num_tok: int = 0
    num_replaced: int = 0

    @property
    def replaced_percent(self) -> float:
        return 100 * self.num_replaced / self.num_tok if self.num_tok else 0.0

    def merge(self, other: BinarizeSummary) -> BinarizeSummary:
        self.num_seq += other.num_seq
        self.num_tok += other.num_tok
        self.num_replaced += other.num_replaced
        return self

    def __str__(self) -> str:  # fairseq's wording and precision
        return f"{self.num_seq} sents, {self.num_tok} tokens, {self.replaced_percent:.3}% replaced"


# --- reading ------------------------------------------------------------------------------
def _next_line_start(f, pos: int, size: int, separator: bytes = b"\n") -> int:
    """The first unit (line) start at or after byte ``pos``."""
    if pos <= 0:
        return 0
    f.seek(pos - 1)
    scanned = pos - 1
    while True:
        block = f.read(1 << 16)
        if not block:
            return size
        i = block.find(separator)
        if i >= 0:
            return scanned + i + 1
        scanned += len(block)


def find_offsets(
    path: str, num_chunks: int, start: int = 0, end: Optional[int] = None, units: Units = LINES
) -> List[int]:
    """``num_chunks + 1`` byte offsets cutting bytes ``[start, end)`` of ``path`` (``start`` a unit start)
    into unit-aligned ranges of about equal size."""
    size = os.path.getsize(path)
    end = size if end is None else end
    offsets = [start] * (num_chunks + 1)
    offsets[-1] = end
    separator = units.separator.encode()
    with open(path, "rb") as f:
        for i in range(1, num_chunks):
            at = start + (end - start) * i // num_chunks
            offsets[i] = min(end, max(offsets[i - 1], _next_line_start(f, at, size, separator)))
    return offsets


def shard_range(path: str, shard: Tuple[int, int], units: Units = LINES) -> Tuple[int, int]:
    """Bytes ``[start, end)`` of part ``shard_id`` of ``num_shards`` (``--shard-id``/``--num-shards``): the same
    unit-aligned cut as ``find_offsets(path, num_shards)``, so the parts joined are the whole file."""
    shard_id, num_shards = shard
    offsets = find_offsets(path, num_shards, units=units)
    return offsets[shard_id], offsets[shard_id + 1]


def line_number_at(path: str, offset: int) -> int:
    """1-based number of the line holding byte ``offset``."""
    lines = 0
    with open(path, "rb") as f:
        remaining = offset
        while remaining > 0:
            block = f.read(min(16 << 20, remaining))
            if not block:
                break
            lines += block.count(b"\n")
            remaining -= len(block)
    return lines + 1


def _decode(path: str, data: bytes, offset: int, errors: str, units: Units = LINES) -> str:
    try:
        text = data.decode("utf-8", errors)
    except UnicodeDecodeError as e:
        at = offset + e.start
        bad = data[e.start : e.start + 4]
        raise UserError(
            f"{path}, line {line_number_at(path, at)}: not valid UTF-8 (byte {at}: {bad!r}, {e.reason}); "
            f"fix or re-encode the file, or pass --encoding-errors replace to go on"
        ) from None
    if units.documents:  # a document reaches the tokenizer as written, its carriage returns included
        return text if text.endswith(units.separator) else text + units.separator
    if "\r" in text:  # universal newlines, as Python's text files (and so fairseq) read lines
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if not text.endswith("\n"):  # a last line without its newline is still a line
        text += "\n"
    return text


def read_blocks(
    path: str,
    start: int = 0,
    end: Optional[int] = None,
    block_bytes: Optional[int] = None,
    encoding_errors: str = "strict",
    units: Units = LINES,
) -> Iterator[Tuple[str, int]]:
    """Yield ``(text, nbytes)``: bytes ``[start, end)`` of ``path`` as text of whole units, each ending in its
    separator (``\\n`` for lines).

    ``start`` must be a unit start (``find_offsets``); a unit longer than a block is read whole.
    """
    if end is None:
        end = os.path.getsize(path)
    block_bytes = block_bytes or BLOCK_BYTES
    separator = units.separator.encode()
    with open(path, "rb") as f:
        f.seek(start)
        pos, carry = start, b""
        while pos < end:
            want = end - pos - len(carry)
            data = f.read(min(block_bytes, want)) if want > 0 else b""
            buf = carry + data if carry else data
            if not buf:
                break
            if pos + len(buf) >= end or not data:
                cut = len(buf)
            else:
                cut = buf.rfind(separator) + 1
                if cut == 0:  # no unit end yet: keep reading
                    carry = buf
                    continue
            carry = buf[cut:]
            yield _decode(path, buf[:cut] if cut < len(buf) else buf, pos, encoding_errors, units), cut
            pos += cut


def iter_units(path: str, encoding_errors: str = "strict", units: Units = LINES) -> Iterator[str]:
    """Every line (or document) of ``path`` without its separator, streamed."""
    for text, _ in read_blocks(path, encoding_errors=encoding_errors, units=units):
        yield from units.split(text)


# --- tokenizers --------------------------------------------------------------------------
_TOKENIZERS: Dict[str, Any] = {}


def get_tokenizer(spec: TokenizerSpec):
    """The tokenizer for a spec, built once per process (None: whitespace)."""
    if spec is None:
        return None
    key = json.dumps(spec, sort_keys=True)
    if key not in _TOKENIZERS:
        from toolkit.tokenizers import build_tokenizer

        _TOKENIZERS[key] = build_tokenizer(spec[0], spec[1])
    return _TOKENIZERS[key]


def template_ends_with(tokenizer, units: Units, eos_word: str) -> bool:
    """Whether the tokenizer's own template ends every document with ``eos_word`` (a tokenizer that appends EOS):
    then that EOS is the document's end and no second one is added."""
    if tokenizer is None or not units.documents:
        return False
    return all(pieces.split()[-1:] == [eos_word] for pieces in units.pieces(tokenizer, ["", "a"]))


def apply_tokenizer(text: str, tokenizer, units: Units = LINES, drop_last: bool = False) -> str:
    """Encode each unit of a block into space-separated pieces: one line of pieces per unit (``drop_last``:
    without the template's final EOS, see :func:`template_ends_with`)."""
    if tokenizer is None:  # whitespace tokens: a document's own newlines separate words, as its spaces do
        return text.replace("\n", " ").replace(units.separator, "\n") if units.documents else text
    items = units.split(text)
    encoded = units.pieces(tokenizer, items)
    if drop_last:
        encoded = [" ".join(pieces.split()[:-1]) for pieces in encoded]
    out = "\n".join(encoded) + "\n"
    if out.count("\n") != len(items):  # a piece held a newline: keep one item per input unit
        out = "\n".join(e.replace("\n", " ") for e in encoded) + "\n"
    return out


# --- counting and binarizing a byte range --------------------------------------------------
def count_range(
    path: str,
    start: int = 0,
    end: Optional[int] = None,
    tokenizer=None,
    encoding_errors: str = "strict",
    progress: Progress = None,
    units: Units = LINES,
) -> Counter:
    """Token counts of the units in bytes ``[start, end)`` (for building ``dict.txt``; ``</s>`` not counted)."""
    counts: Counter = Counter()
    drop_last = template_ends_with(tokenizer, units, "</s>")
    for text, nbytes in read_blocks(path, start, end, encoding_errors=encoding_errors, units=units):
        counts.update(apply_tokenizer(text, tokenizer, units, drop_last).split())
        if progress is not None:
            progress(nbytes)
    return counts


class _UnkLookup(dict):
    """word -> id; a missing word gives ``<unk>``'s id and is counted (fairseq's "replaced")."""

    __slots__ = ("unk", "misses")

    @classmethod
    def of(cls, dictionary) -> _UnkLookup:
        lookup = cls(dictionary.indices)
        lookup.unk, lookup.misses = dictionary.unk_index, 0
        return lookup

    def __missing__(self, word: str) -> int:
        self.misses += 1
        return self.unk


def encode_block(text: str, lookup, eos: int, eos_word: str, dtype, fast: bool = True) -> Tuple[np.ndarray, np.ndarray]:
    """Ids and item sizes of a block of whole lines (each ending in "\\n"), ``</s>`` after each line.

    The fast path turns newlines into ``</s>`` and maps all words in one C-level pass;
    a literal ``</s>`` in the text would then split a line, so such blocks go line by line.
    """
    if fast and eos_word not in text:
        words = text.replace("\n", f" {eos_word} ").split()
        ids = np.fromiter(map(lookup, words), dtype=dtype, count=len(words))
        sizes = np.diff(np.flatnonzero(ids == eos), prepend=-1).astype(np.int32)
        return ids, sizes
    flat: List[int] = []
    size_list: List[int] = []
    lines = text.split("\n")
    lines.pop()
    for line in lines:
        words = line.split()
        flat += map(lookup, words)
        flat.append(eos)
        size_list.append(len(words) + 1)
    return np.array(flat, dtype=dtype), np.array(size_list, dtype=np.int32)


class BlockEncoder:
    """Maps a block of lines to (ids, item sizes, tokens replaced by ``<unk>``) with a known dictionary."""

    def __init__(self, dictionary, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        if len(dictionary) > np.iinfo(self.dtype).max + 1:
            raise ValueError(f"dtype {self.dtype} cannot hold {len(dictionary)} token ids")
        self.lookup = _UnkLookup.of(dictionary)
        self.eos, self.eos_word = dictionary.eos_index, dictionary.eos_word
        # the fast path needs the literal eos word to map to the eos index
        self.fast = dictionary.indices.get(self.eos_word) == self.eos

    def encode(self, text: str) -> Tuple[np.ndarray, np.ndarray, int]:
        misses_before = self.lookup.misses
        ids, sizes = encode_block(text, self.lookup.__getitem__, self.eos, self.eos_word, self.dtype, fast=self.fast)
        return ids, sizes, self.lookup.misses - misses_before


def tokenizer_id_pieces(tokenizer) -> Optional[List[Optional[str]]]:
    """The tokenizer's piece for each of its ids, where looking its ids up through them gives exactly what
    the text path gives; None where no id has such a piece.

    An id keeps its piece when that piece is one whitespace-free word found at no other id; the others are
    None (``Tokenizer.id_pieces`` gives None where the text varies, e.g. sentencepiece's unk id, whose text
    is the unknown characters themselves): a line holding such an id takes the text path (``TokenizedBlock``).
    """
    pieces = tokenizer.id_pieces() if tokenizer is not None else None
    if not pieces:
        return None
    fixed = [p if isinstance(p, str) and p.split() == [p] else None for p in pieces]
    seen = Counter(p for p in fixed if p is not None)
    fixed = [p if p is not None and seen[p] == 1 else None for p in fixed]
    return fixed if any(p is not None for p in fixed) else None


@dataclass
class TokenizedBlock:
    """A block's lines through a tokenizer's ids: the library's ids of the lines whose pieces all come from
    ``tokenizer_id_pieces`` (``ids``, flat), and the text path's words of the other lines (``redo``, of the
    lines where ``is_redo``); ``lengths`` is the number of pieces of every line."""

    ids: np.ndarray
    lengths: np.ndarray
    is_redo: np.ndarray
    redo: List[List[str]]

    @classmethod
    def of(
        cls, tokenizer, text: str, varying: np.ndarray, units: Units = LINES, drop_last: bool = False
    ) -> TokenizedBlock:
        """``varying``: True at the ids without a fixed piece; ``drop_last``: leave out each unit's last id (the
        template's EOS, :func:`template_ends_with`)."""
        lines = units.split(text)
        per_line = units.ids(tokenizer, lines)
        if drop_last:
            per_line = [ids[:-1] for ids in per_line]
        lengths = np.fromiter(map(len, per_line), dtype=np.int64, count=len(per_line))
        flat = np.fromiter(itertools.chain.from_iterable(per_line), dtype=np.int64, count=int(lengths.sum()))
        hits = varying[flat]
        if not hits.any():
            return cls(flat, lengths, np.zeros(len(lines), dtype=bool), [])
        line_of = np.repeat(np.arange(len(lines)), lengths)
        redo_lines = np.unique(line_of[hits])
        redo = [encoded.split() for encoded in units.pieces(tokenizer, [lines[i] for i in redo_lines.tolist()])]
        if drop_last:
            redo = [words[:-1] for words in redo]
        is_redo = np.zeros(len(lines), dtype=bool)
        is_redo[redo_lines] = True
        lengths[redo_lines] = [len(words) for words in redo]
        return cls(flat[~is_redo[line_of]], lengths, is_redo, redo)

    @property
    def sizes(self) -> np.ndarray:
        """Each line's item size: its pieces and ``</s>``."""
        return (self.lengths + 1).astype(np.int32)

    def with_line_ends(self, mapped: np.ndarray, redo_ids: List[np.ndarray], eos: int, dtype) -> np.ndarray:
        """The block's items: ``mapped`` (``ids`` mapped) and ``redo_ids`` (``redo`` mapped) put back in line
        order, ``eos`` after each line."""
        if not self.redo:
            return with_line_ends(mapped, self.sizes, eos, dtype)
        values = np.empty(int(self.lengths.sum()), dtype=np.int64)
        at_redo = np.repeat(self.is_redo, self.lengths)
        values[~at_redo] = mapped
        values[at_redo] = np.concatenate(redo_ids)
        return with_line_ends(values, self.sizes, eos, dtype)


def varying_ids(pieces: List[Optional[str]]) -> np.ndarray:
    """True at the ids without a fixed piece: a line holding one is encoded as text."""
    return np.fromiter((p is None for p in pieces), dtype=bool, count=len(pieces))


def with_line_ends(values: np.ndarray, sizes: np.ndarray, eos: int, dtype) -> np.ndarray:
    """``values`` with ``eos`` after each line (the last position of each item)."""
    ids = np.full(int(sizes.sum()), eos, dtype=dtype)
    words = np.ones(len(ids), dtype=bool)
    words[np.cumsum(sizes) - 1] = False
    ids[words] = values
    return ids


class TokenizerIdEncoder:
    """A block of lines through a tokenizer straight to ``dict.txt`` ids: its ids, then one array lookup.

    Gives what ``BlockEncoder`` gives on ``apply_tokenizer``'s text (``tokenizer_id_pieces``; otherwise
    ``build`` returns None and the text path is used): a piece missing from the dictionary becomes
    ``<unk>`` and is counted as replaced, a piece that is literally ``<unk>`` or ``</s>`` maps to its own
    id, and ``</s>`` ends each line. Lines holding an id without a fixed piece are looked up word by word.
    """

    def __init__(self, tokenizer, dictionary, pieces: List[Optional[str]], dtype, units: Units = LINES):
        self.tokenizer, self.dtype, self.eos = tokenizer, np.dtype(dtype), dictionary.eos_index
        self.units, self.drop_last = units, template_ends_with(tokenizer, units, dictionary.eos_word)
        get, unk = dictionary.indices.get, dictionary.unk_index
        self.table = np.fromiter((get(p, unk) for p in pieces), dtype=np.int64, count=len(pieces))
        self.replaced = np.fromiter(
            (p is not None and p not in dictionary.indices for p in pieces), dtype=bool, count=len(pieces)
        )
        self.varying = varying_ids(pieces)
        self.lookup = _UnkLookup.of(dictionary)

    @classmethod
    def build(cls, tokenizer, dictionary, dtype, units: Units = LINES) -> Optional[TokenizerIdEncoder]:
        pieces = tokenizer_id_pieces(tokenizer)
        return None if pieces is None else cls(tokenizer, dictionary, pieces, dtype, units)

    def encode(self, text: str) -> Tuple[np.ndarray, np.ndarray, int]:
        block = TokenizedBlock.of(self.tokenizer, text, self.varying, self.units, self.drop_last)
        misses_before = self.lookup.misses
        redo_ids = [
            np.fromiter(map(self.lookup.__getitem__, words), dtype=np.int64, count=len(words)) for words in block.redo
        ]
        replaced = int(self.replaced[block.ids].sum()) + self.lookup.misses - misses_before
        return block.with_line_ends(self.table[block.ids], redo_ids, self.eos, self.dtype), block.sizes, replaced


def binarize_range(
    path: str,
    start: int,
    end: Optional[int],
    dictionary,
    builder: MMapIndexedDatasetBuilder,
    tokenizer=None,
    encoding_errors: str = "strict",
    progress: Progress = None,
    units: Units = LINES,
) -> BinarizeSummary:
    """Append the units in bytes ``[start, end)`` to ``builder`` as items (``</s>`` appended)."""
    encoder = BlockEncoder(dictionary, builder.dtype)
    by_ids = TokenizerIdEncoder.build(tokenizer, dictionary, builder.dtype, units)
    drop_last = by_ids is None and template_ends_with(tokenizer, units, dictionary.eos_word)
    summary = BinarizeSummary()
    for text, nbytes in read_blocks(path, start, end, encoding_errors=encoding_errors, units=units):
        if by_ids is not None:
            ids, sizes, replaced = by_ids.encode(text)
        else:
            ids, sizes, replaced = encoder.encode(apply_tokenizer(text, tokenizer, units, drop_last))
        builder.add_items(ids, sizes)
        summary.num_seq += len(sizes)
        summary.num_tok += len(ids)
        summary.num_replaced += replaced
        if progress is not None:
            progress(nbytes)
    return summary


# --- train split: one pass for counts and ids ----------------------------------------------
class ProvisionalEncoder:
    """Ids in order of first appearance, so counting and binarizing take one pass over the text.

    ``ids = map(vocab.__getitem__, words)`` on a ``defaultdict`` whose factory
    hands out the next id runs in C; the counts are ``np.bincount`` of the ids.
    Once ``dict.txt`` is known the ids are renumbered with one array lookup.
    """

    def __init__(self, eos_word: str = "</s>"):
        self.vocab: Dict[str, int] = defaultdict(itertools.count().__next__)
        self.eos_word = eos_word
        self.eos = self.vocab[eos_word]  # every line ends with it, as the final ids end with </s>
        self.counts = np.zeros(1024, dtype=np.int64)

    def encode(self, text: str) -> Tuple[np.ndarray, np.ndarray]:
        ids, sizes = encode_block(text, self.vocab.__getitem__, self.eos, self.eos_word, np.int32)
        if len(self.vocab) > len(self.counts):
            self.counts = np.concatenate(
                [self.counts, np.zeros(max(len(self.vocab), 2 * len(self.counts)) - len(self.counts), dtype=np.int64)]
            )
        if len(ids):
            found = np.bincount(ids)
            self.counts[: len(found)] += found
        return ids, sizes

    def words(self) -> List[str]:
        return list(self.vocab)  # insertion order is id order

    def word_counts(self) -> np.ndarray:
        return self.counts[: len(self.vocab)].copy()


class ProvisionalIdEncoder:
    """``ProvisionalEncoder`` for a tokenizer with ``tokenizer_id_pieces``: its own ids are the provisional ids
    (``</s>`` its piece's id, or one more id), so no piece text is made; unseen pieces keep a count of 0.
    The words of lines taken by the text path (``TokenizedBlock.redo``) keep their piece's id, or get the
    next ids after the tokenizer's."""

    def __init__(self, tokenizer, pieces: List[Optional[str]], eos_word: str = "</s>", units: Units = LINES):
        self.tokenizer = tokenizer
        self.units, self.drop_last = units, template_ends_with(tokenizer, units, eos_word)
        self.pieces = pieces if eos_word in pieces else pieces + [eos_word]
        self.varying = varying_ids(self.pieces)
        self.vocab: Dict[str, int] = defaultdict(itertools.count(len(self.pieces)).__next__)
        self.vocab.update((p, i) for i, p in enumerate(self.pieces) if p is not None)
        self.fixed = len(self.vocab)
        self.eos = self.vocab[eos_word]
        self.counts = np.zeros(len(self.pieces), dtype=np.int64)

    def encode(self, text: str) -> Tuple[np.ndarray, np.ndarray]:
        block = TokenizedBlock.of(self.tokenizer, text, self.varying, self.units, self.drop_last)
        redo_ids = [
            np.fromiter(map(self.vocab.__getitem__, words), dtype=np.int64, count=len(words)) for words in block.redo
        ]
        ids = block.with_line_ends(block.ids, redo_ids, self.eos, np.int32)
        found = np.bincount(ids, minlength=len(self.counts))
        if len(found) > len(self.counts):
            self.counts = np.concatenate([self.counts, np.zeros(len(found) - len(self.counts), dtype=np.int64)])
        self.counts += found
        return ids, block.sizes

    def words(self) -> List[Optional[str]]:
        """Each provisional id's word (None at the ids without a fixed piece: never in the ids, count 0)."""
        return self.pieces + list(itertools.islice(self.vocab, self.fixed, None))

    def word_counts(self) -> np.ndarray:
        missing = len(self.pieces) + len(self.vocab) - self.fixed - len(self.counts)
        return np.concatenate([self.counts, np.zeros(missing, dtype=np.int64)])


@dataclass
class ProvisionalPart:
    """One byte range of the train file, binarized with provisional ids (``prefix.bin/.idx``, int32)."""

    prefix: str
    words: List[str]
    counts: np.ndarray  # occurrences of each word (the line ends included, as "</s>")
    summary: BinarizeSummary = field(default_factory=BinarizeSummary)


def provisional_range(
    path: str,
    start: int,
    end: Optional[int],
    out_prefix: str,
    tokenizer=None,
    encoding_errors: str = "strict",
    progress: Progress = None,
    units: Units = LINES,
) -> ProvisionalPart:
    pieces = tokenizer_id_pieces(tokenizer)
    encoder = ProvisionalEncoder() if pieces is None else ProvisionalIdEncoder(tokenizer, pieces, units=units)
    drop_last = pieces is None and template_ends_with(tokenizer, units, "</s>")
    builder = MMapIndexedDatasetBuilder(data_file_path(out_prefix), dtype=np.int32)
    summary = BinarizeSummary()
    for text, nbytes in read_blocks(path, start, end, encoding_errors=encoding_errors, units=units):
        ids, sizes = encoder.encode(text if pieces is not None else apply_tokenizer(text, tokenizer, units, drop_last))
        builder.add_items(ids, sizes)
        summary.num_seq += len(sizes)
        summary.num_tok += len(ids)
        if progress is not None:
            progress(nbytes)
    builder.finalize(index_file_path(out_prefix))
    return ProvisionalPart(out_prefix, encoder.words(), encoder.word_counts(), summary)


def part_counts(parts: Sequence[ProvisionalPart]) -> Counter:
    """The token counts of all parts (for ``Dictionary.add_counts``)."""
    total: Counter = Counter()
    for part in parts:
        counts = {w: c for w, c in zip(part.words, part.counts.tolist()) if c}  # a piece never seen is no word
        if not total:
            total = Counter(counts)
        else:
            total.update(counts)
    return total


def finish_provisional(parts: Sequence[ProvisionalPart], out_prefix: str, dictionary, dtype) -> BinarizeSummary:
    """Renumber the parts' ids with the final dictionary into ``{out_prefix}.bin/.idx``; delete the parts."""
    dtype = np.dtype(dtype)
    builder = MMapIndexedDatasetBuilder(data_file_path(out_prefix), dtype=dtype)
    summary = BinarizeSummary()
    get, unk = dictionary.indices.get, dictionary.unk_index
    for part in parts:
        remap = np.fromiter(map(get, part.words, itertools.repeat(unk)), dtype=np.int64, count=len(part.words))
        replaced = remap == unk
        if dictionary.unk_word in part.words:  # a literal <unk> is not a replacement (fairseq)
            replaced[part.words.index(dictionary.unk_word)] = False
        summary.merge(part.summary)
        summary.num_replaced += int(part.counts[replaced].sum())
        builder.merge_file_(part.prefix, remap=remap)
        os.remove(data_file_path(part.prefix))
        os.remove(index_file_path(part.prefix))
    builder.finalize(index_file_path(out_prefix))
    return summary


# --- worker processes --------------------------------------------------------------------
_worker_progress = None  # a shared byte counter, in worker processes


def _init_worker(progress_value) -> None:
    global _worker_progress
    _worker_progress = progress_value
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and terminates the pool
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process


def _report(nbytes: int) -> None:
    with _worker_progress.get_lock():
        _worker_progress.value += nbytes


def _count_task(path: str, start: int, end: int, spec: TokenizerSpec, encoding_errors: str, units: Units) -> Counter:
    return count_range(path, start, end, get_tokenizer(spec), encoding_errors, _report, units)


def _binarize_task(
    path: str,
    start: int,
    end: int,
    dictionary,
    out_prefix: str,
    dtype: str,
    spec: TokenizerSpec,
    encoding_errors: str,
    units: Units,
) -> BinarizeSummary:
    builder = MMapIndexedDatasetBuilder(data_file_path(out_prefix), dtype=np.dtype(dtype))
    tokenizer = get_tokenizer(spec)
    summary = binarize_range(path, start, end, dictionary, builder, tokenizer, encoding_errors, _report, units)
    builder.finalize(index_file_path(out_prefix))
    return summary


def _provisional_task(
    path: str, start: int, end: int, out_prefix: str, spec: TokenizerSpec, encoding_errors: str, units: Units
) -> ProvisionalPart:
    return provisional_range(path, start, end, out_prefix, get_tokenizer(spec), encoding_errors, _report, units)


class Workers:
    """``--workers N``: N processes (none when N is 1), forked once and reused for every file.

    Fork them before any tokenizer library starts threads (e.g. before training a BPE).
    """

    def __init__(self, num_workers: int):
        self.num_workers = max(1, int(num_workers))
        self.pool = None
        if self.num_workers > 1:
            methods = multiprocessing.get_all_start_methods()
            ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
            self.progress = ctx.Value("q", 0)
            # the children inherit this at fork time: no thread pools inside them, and no warning from
            # HF tokenizers if this process already used its threads
            previous = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            try:
                self.pool = ctx.Pool(self.num_workers, initializer=_init_worker, initargs=(self.progress,))
            finally:
                if previous is None:
                    del os.environ["TOKENIZERS_PARALLELISM"]
                else:
                    os.environ["TOKENIZERS_PARALLELISM"] = previous

    def run(self, func: Callable, tasks: Sequence[tuple], progress: Progress = None) -> list:
        """``func(*task)`` for every task in the pool; results in task order; progress in bytes."""
        with self.progress.get_lock():
            self.progress.value = 0
        result = self.pool.starmap_async(func, tasks, chunksize=1)
        reported = 0
        while not result.ready():
            result.wait(0.2)
            done = self.progress.value
            if progress is not None and done > reported:
                progress(done - reported)
                reported = done
        values = result.get()  # re-raises a worker's exception (e.g. UserError) here
        if progress is not None and self.progress.value > reported:
            progress(self.progress.value - reported)
        return values

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool.join()
            self.pool = None

    def terminate(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.terminate()


# --- whole files ---------------------------------------------------------------------------
def count_file(
    path: str,
    workers: Workers,
    tokenizer_spec: TokenizerSpec = None,
    encoding_errors: str = "strict",
    progress: Progress = None,
    units: Units = LINES,
) -> Counter:
    """Token counts of a whole file, each worker counting one unit-aligned range."""
    if workers.num_workers == 1:
        return count_range(path, 0, None, get_tokenizer(tokenizer_spec), encoding_errors, progress, units)
    offsets = find_offsets(path, workers.num_workers, units=units)
    tasks = [(path, s, e, tokenizer_spec, encoding_errors, units) for s, e in zip(offsets, offsets[1:])]
    results = workers.run(_count_task, tasks, progress)
    total = results[0]
    for counts in results[1:]:
        total.update(counts)
    return total


def worker_prefix(out_prefix: str, worker_id: int) -> str:
    return f"{out_prefix}.pt{worker_id}"


def binarize_file(
    path: str,
    out_prefix: str,
    dictionary,
    dtype,
    workers: Workers,
    tokenizer_spec: TokenizerSpec = None,
    encoding_errors: str = "strict",
    progress: Progress = None,
    shard: Tuple[int, int] = (0, 1),
    units: Units = LINES,
) -> BinarizeSummary:
    """Write ``{out_prefix}.bin/.idx`` holding one item per line (or document) of ``path`` (of its part
    ``shard``: ``(shard_id, num_shards)``)."""
    dtype = np.dtype(dtype)
    builder = MMapIndexedDatasetBuilder(data_file_path(out_prefix), dtype=dtype)
    start, end = shard_range(path, shard, units)
    if workers.num_workers == 1:
        tokenizer = get_tokenizer(tokenizer_spec)
        summary = binarize_range(path, start, end, dictionary, builder, tokenizer, encoding_errors, progress, units)
    else:
        offsets = find_offsets(path, workers.num_workers, start, end, units)
        parts = [worker_prefix(out_prefix, i) for i in range(workers.num_workers)]
        tasks = [
            (path, s, e, dictionary, part, dtype.str, tokenizer_spec, encoding_errors, units)
            for (s, e), part in zip(zip(offsets, offsets[1:]), parts)
        ]
        summary = BinarizeSummary()
        for part_summary in workers.run(_binarize_task, tasks, progress):
            summary.merge(part_summary)
        for part in parts:
            builder.merge_file_(part)
            os.remove(data_file_path(part))
            os.remove(index_file_path(part))
    builder.finalize(index_file_path(out_prefix))
    return summary


def provisional_file(
    path: str,
    out_prefix: str,
    workers: Workers,
    tokenizer_spec: TokenizerSpec = None,
    encoding_errors: str = "strict",
    progress: Progress = None,
    units: Units = LINES,
) -> List[ProvisionalPart]:
    """First pass over the train file: counts and provisional ids, one part per worker (see ``finish_provisional``)."""
    if workers.num_workers == 1:
        tokenizer = get_tokenizer(tokenizer_spec)
        prefix = worker_prefix(out_prefix, 0)
        return [provisional_range(path, 0, None, prefix, tokenizer, encoding_errors, progress, units)]
    offsets = find_offsets(path, workers.num_workers, units=units)
    tasks = [
        (path, s, e, worker_prefix(out_prefix, i), tokenizer_spec, encoding_errors, units)
        for i, (s, e) in enumerate(zip(offsets, offsets[1:]))
    ]
    return workers.run(_provisional_task, tasks, progress)
