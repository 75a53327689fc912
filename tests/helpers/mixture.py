"""Two small text sources for the data-mixture tests of both tiers."""

from __future__ import annotations

import numpy as np

from tests.helpers.lm_fixtures import make_data_bin

WORDS = "the cat sat on a mat dogs ran in park birds sang over tall green trees".split()


def make_sources(root):
    """Three data-bins under ``root``: web and code share a dictionary, other has its own."""
    rng = np.random.RandomState(0)

    def lines(n, vocab):
        return [" ".join(rng.choice(vocab, size=rng.randint(3, 25))) for _ in range(n)]

    make_data_bin(root / "web", {"train": lines(400, WORDS[:10]), "valid": lines(40, WORDS[:10])}, symbols=WORDS)
    make_data_bin(root / "code", {"train": lines(120, WORDS[6:]), "valid": lines(30, WORDS[6:])}, symbols=WORDS)
    make_data_bin(root / "other", {"train": lines(50, WORDS)})  # its own dictionary
    return root
