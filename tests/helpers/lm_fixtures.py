"""Tiny data-bins for tests, written with the toolkit's own Dictionary and mmap builder.

    from tests.helpers.lm_fixtures import make_data_bin
    d = make_data_bin(tmp_path / "bin", {"train": ["a b c", "", "d e"], "valid": ["a b"]})

Lines are tokenized on whitespace and end with ``</s>`` (an empty line is just
``</s>``, a document separator), as ``toolkit-preprocess`` / fairseq-preprocess do.
"""

from __future__ import annotations

import os
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np

from toolkit.data.dictionary import Dictionary
from toolkit.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype


def build_dictionary(
    lines: Iterable[str], symbols: Optional[Sequence[str]] = None, padding_factor: int = 8
) -> Dictionary:
    """``symbols`` given: exactly those, in that order, after the 4 specials (ids 4, 5, ...).
    Otherwise: every word of ``lines``, sorted by frequency as fairseq-preprocess does."""
    d = Dictionary()
    if symbols is not None:
        for sym in symbols:
            d.add_symbol(sym)
        return d
    d.add_counts(Dictionary.count_words(lines))
    d.finalize(padding_factor=padding_factor)
    return d


def encode_lines(dictionary: Dictionary, lines: Iterable[str]) -> List[np.ndarray]:
    return [dictionary.encode_line(line).numpy().astype(np.int64) for line in lines]


def write_split(prefix: str, items: Sequence[np.ndarray], vocab_size: int) -> None:
    """``{prefix}.bin/.idx`` holding ``items`` (1-D int arrays)."""
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=best_fitting_dtype(vocab_size))
    if items:
        builder.add_items(np.concatenate(items), np.array([len(x) for x in items]))
    builder.finalize(prefix + ".idx")


def make_data_bin(
    dest,
    lines_by_split: Dict[str, Sequence[str]],
    symbols: Optional[Sequence[str]] = None,
    dict_splits: Optional[Sequence[str]] = None,
    padding_factor: int = 8,
) -> Dictionary:
    """Write ``dest/dict.txt`` and ``dest/{split}.bin/.idx`` for every split; return the Dictionary.

    The dictionary is built from ``dict_splits`` (default: "train" if given, else all
    splits), or is exactly ``symbols`` when given. Unknown words become ``<unk>``.
    """
    dest = str(dest)
    os.makedirs(dest, exist_ok=True)
    if dict_splits is None:
        dict_splits = ["train"] if "train" in lines_by_split else list(lines_by_split)
    dict_lines = [line for split in dict_splits for line in lines_by_split[split]]
    dictionary = build_dictionary(dict_lines, symbols=symbols, padding_factor=padding_factor)
    dictionary.save(os.path.join(dest, "dict.txt"))
    for split, lines in lines_by_split.items():
        write_split(os.path.join(dest, split), encode_lines(dictionary, lines), len(dictionary))
    return dictionary


def read_lines(path: str, max_lines: Optional[int] = None) -> List[str]:
    out: List[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if max_lines is not None and len(out) >= max_lines:
                break
            out.append(line.rstrip("\n"))
    return out


def make_wikitext_data_bin(
    dest, wikitext_dir: str, max_train_lines: int = 2000, max_valid_lines: int = 200
) -> Dictionary:
    """A data-bin of the first lines of ``wikitext-2-mini`` (whitespace tokens)."""
    return make_data_bin(
        dest,
        {
            "train": read_lines(os.path.join(wikitext_dir, "wiki.train.tokens"), max_train_lines),
            "valid": read_lines(os.path.join(wikitext_dir, "wiki.valid.tokens"), max_valid_lines),
        },
    )
