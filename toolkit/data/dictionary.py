"""fairseq's vocabulary: ``dict.txt`` holds "token count" per line, specials implicit.

Indices 0-3 are always ``<s>``, ``<pad>``, ``</s>``, ``<unk>`` (not written to
``dict.txt``), so a data-bin made here loads in fairseq and the other way round.

A tokenizer's own vocabulary (a model imported from Hugging Face, whose ids must not move) is
the other form: the first line is ``#toolkit:vocabulary bos=I pad=J eos=K unk=L`` and every
symbol follows in id order, the specials where that tokenizer puts them
(:meth:`Dictionary.from_vocabulary`). fairseq cannot read it; the toolkit reads both.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from typing import Callable, Dict, Iterable, List, Sequence

import torch

from toolkit.core.errors import UserError
from toolkit.core.fileio import atomic_write


class Dictionary:
    def __init__(self, bos: str = "<s>", pad: str = "<pad>", eos: str = "</s>", unk: str = "<unk>"):
        self.bos_word, self.pad_word, self.eos_word, self.unk_word = bos, pad, eos, unk
        self.symbols: List[str] = []
        self.count: List[int] = []
        self.indices: Dict[str, int] = {}
        self.bos_index = self.add_symbol(bos)
        self.pad_index = self.add_symbol(pad)
        self.eos_index = self.add_symbol(eos)
        self.unk_index = self.add_symbol(unk)
        self.nspecial = len(self.symbols)

    def __len__(self) -> int:
        return len(self.symbols)

    def __getitem__(self, idx: int) -> str:
        return self.symbols[idx] if idx < len(self.symbols) else self.unk_word

    def __contains__(self, sym: str) -> bool:
        return sym in self.indices

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Dictionary) and self.symbols == other.symbols

    def symbols_hash(self) -> str:
        """Identity of the vocabulary: sha256 of the symbols in order (first 16 hex digits).

        Same-size dictionaries in another order give the same shapes but other ids, so a
        checkpoint evaluated on them reports nonsense without error; this tells them apart.
        """
        digest = hashlib.sha256("\n".join(self.symbols).encode("utf-8")).hexdigest()
        return digest[:16]

    def bos(self) -> int:
        return self.bos_index

    def pad(self) -> int:
        return self.pad_index

    def eos(self) -> int:
        return self.eos_index

    def unk(self) -> int:
        return self.unk_index

    def index(self, sym: str) -> int:
        return self.indices.get(sym, self.unk_index)

    def add_symbol(self, word: str, n: int = 1, overwrite: bool = False) -> int:
        if word in self.indices and not overwrite:
            idx = self.indices[word]
            self.count[idx] += n
            return idx
        idx = len(self.symbols)
        self.indices[word] = idx
        self.symbols.append(word)
        self.count.append(n)
        return idx

    def add_counts(self, counts: Dict[str, int]) -> None:
        for word, n in counts.items():
            self.add_symbol(word, n)

    def finalize(self, threshold: int = -1, nwords: int = -1, padding_factor: int = 8) -> None:
        """Sort by frequency (ties alphabetically, as fairseq), cut, and pad the size.

        Padding to a multiple of 8 keeps the embedding and output matrices
        aligned for tensor cores; the filler symbols are ``madeupwordNNNN``.
        """
        if nwords <= 0:
            nwords = len(self)
        special = self.symbols[: self.nspecial]
        rest = sorted(zip(self.symbols[self.nspecial :], self.count[self.nspecial :]), key=lambda x: (-x[1], x[0]))
        symbols, counts = list(special), list(self.count[: self.nspecial])
        for sym, c in rest:
            if len(symbols) >= nwords or c < threshold:
                break
            symbols.append(sym)
            counts.append(c)
        self.symbols, self.count = symbols, counts
        self.indices = {s: i for i, s in enumerate(symbols)}
        self.pad_to_multiple_(padding_factor)

    def pad_to_multiple_(self, padding_factor: int) -> None:
        if padding_factor > 1:
            i = 0
            while len(self) % padding_factor != 0:
                self.add_symbol(f"madeupword{i:04d}", n=0)
                i += 1

    # --- text <-> ids -------------------------------------------------------------
    def encode_line(
        self,
        line: str,
        line_tokenizer: Callable[[str], List[str]] = str.split,
        add_if_not_exist: bool = False,
        append_eos: bool = True,
    ) -> torch.IntTensor:
        words = line_tokenizer(line)
        if add_if_not_exist:
            ids = [self.add_symbol(w) for w in words]
        else:
            get, unk = self.indices.get, self.unk_index
            ids = [get(w, unk) for w in words]
        if append_eos:
            ids.append(self.eos_index)
        return torch.tensor(ids, dtype=torch.int32)

    def string(self, tensor: Sequence[int] | torch.Tensor, extra_symbols_to_ignore: Iterable[int] = ()) -> str:
        """Ids back to space-separated tokens, dropping padding and eos."""
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.tolist()
        ignore = {self.pad_index, self.eos_index, *extra_symbols_to_ignore}
        return " ".join(self[i] for i in tensor if i not in ignore)

    @classmethod
    def from_vocabulary(cls, symbols: Sequence[str], bos: int, pad: int, eos: int, unk: int) -> Dictionary:
        """A tokenizer's vocabulary as it is: symbol ``i`` has id ``i``, the specials at the given ids."""
        d = cls()
        d.symbols, d.count, d.indices, d.nspecial = [], [], {}, 0
        for sym in symbols:
            if sym in d.indices or not sym or any(c.isspace() for c in sym):
                raise ValueError(
                    f"vocabulary symbol {sym!r} (id {len(d.symbols)}) is empty, repeated or holds "
                    "whitespace; dict.txt cannot keep it"
                )
            d.add_symbol(sym)
        d.bos_index, d.pad_index, d.eos_index, d.unk_index = bos, pad, eos, unk
        d.bos_word, d.pad_word, d.eos_word, d.unk_word = d[bos], d[pad], d[eos], d[unk]
        d.fixed_ids = True
        return d

    fixed_ids = False  # True for a tokenizer's vocabulary (from_vocabulary): no implicit specials

    # --- files --------------------------------------------------------------------
    @classmethod
    def load(cls, path: str) -> Dictionary:
        header = _vocabulary_header(path)
        if header is not None:
            return cls._load_vocabulary(path, header)
        d = cls()
        d.add_from_file(path)
        return d

    @classmethod
    def _load_vocabulary(cls, path: str, specials: Dict[str, int]) -> Dictionary:
        with open(path, encoding="utf-8") as f:
            symbols = [line.rstrip("\n").rsplit(" ", 1)[0] for line in f.readlines()[1:]]
        if any(not 0 <= i < len(symbols) for i in specials.values()):
            raise UserError(f"{path}: special ids {specials} outside its {len(symbols)} symbols; re-import the model")
        return cls.from_vocabulary(symbols, **specials)

    def add_from_file(self, path: str) -> None:
        if not os.path.isfile(path):
            raise UserError(f"{path}: dictionary file not found; give the dict.txt written by toolkit-preprocess")
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.readlines()
        except UnicodeDecodeError as e:
            raise UserError(f"{path}: not a UTF-8 text dictionary ({e.reason}); expected 'token count' lines")
        for lineno, line in enumerate(lines, start=1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            overwrite = False
            fields = line.rsplit(" ", 1)
            if len(fields) == 2 and fields[1] == "#fairseq:overwrite":
                overwrite = True
                fields = fields[0].rsplit(" ", 1)
            if len(fields) != 2 or not fields[1].lstrip("-").isdigit() or not fields[0]:
                raise UserError(
                    f"{path}, line {lineno}: expected '<token> <count>', got {line[:60]!r}; "
                    f"is this a dict.txt written by toolkit-preprocess or fairseq-preprocess?"
                )
            word, count = fields[0], int(fields[1])
            if word in self.indices and not overwrite:
                raise UserError(
                    f"{path}, line {lineno}: duplicate token {word!r}; "
                    f"add '#fairseq:overwrite' to the line if that is intended"
                )
            self.add_symbol(word, n=count, overwrite=overwrite)

    def save(self, path: str) -> None:
        with atomic_write(path, "w", encoding="utf-8") as f:
            if self.fixed_ids:
                f.write(
                    f"{VOCABULARY_HEADER} bos={self.bos_index} pad={self.pad_index} eos={self.eos_index} "
                    f"unk={self.unk_index}\n"
                )
            for sym, c in zip(self.symbols[self.nspecial :], self.count[self.nspecial :]):
                f.write(f"{sym} {c}\n")

    @staticmethod
    def count_words(lines: Iterable[str], tokenize: Callable[[str], List[str]] = str.split) -> Counter:
        counts: Counter = Counter()
        for line in lines:
            counts.update(tokenize(line))
        return counts


VOCABULARY_HEADER = "#toolkit:vocabulary"


def reads_bos_as_context(dict_path: str) -> bool:
    """Whether a data-bin's ``dict.txt`` is a tokenizer's vocabulary with a BOS of its own, read from its first
    line only: then ``--add-bos-token`` reads BOS as the context a text starts from (nothing is prepended, no
    sample grows by a token; ``toolkit.tasks.language_modeling.bos_as_context``)."""
    header = _vocabulary_header(dict_path) if os.path.isfile(dict_path) else None
    return header is not None and header["bos"] != header["eos"]


def _vocabulary_header(path: str):
    """The special ids of a tokenizer-vocabulary dict.txt (first line ``#toolkit:vocabulary bos=..``), else None."""
    try:
        with open(path, encoding="utf-8") as f:
            first = f.readline().split()
    except (OSError, UnicodeDecodeError):
        return None  # add_from_file reports it
    if not first or first[0] != VOCABULARY_HEADER:
        return None
    try:
        specials = {key: int(value) for key, value in (field.split("=", 1) for field in first[1:])}
    except ValueError:
        specials = {}
    if set(specials) != {"bos", "pad", "eos", "unk"}:
        raise UserError(f"{path}: first line {' '.join(first)!r} must be '{VOCABULARY_HEADER} bos=I pad=J eos=K unk=L'")
    return specials
