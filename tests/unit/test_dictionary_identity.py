"""A checkpoint refuses a data-bin whose dict.txt has the same size but other symbols or order."""

from __future__ import annotations

import hashlib

from toolkit.data.dictionary import Dictionary


def test_hash_is_the_symbols_in_order():
    d = Dictionary()
    for sym in ("b", "a"):
        d.add_symbol(sym)
    assert d.symbols_hash() == hashlib.sha256(b"<s>\n<pad>\n</s>\n<unk>\nb\na").hexdigest()[:16]
    e = Dictionary()
    for sym in ("a", "b"):
        e.add_symbol(sym)
    assert e.symbols_hash() != d.symbols_hash() and len(e) == len(d)
