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


MIXTURE = "mixture"
"""A placeholder in a parametrized case's flags for :func:`mixture_flags` (tests that list features as flags)."""


def mixture_flags(root) -> list:
    """``--data-mixture`` over the web (0.7) and code (0.3) sources that :func:`make_sources` wrote under ``root``."""
    return ["--data-mixture", f"web={root}/web:0.7,code={root}/code:0.3"]


def data_and_flags(data_bin: str, flags, mixture: list):
    """The data-bin argument and ``flags`` with the :data:`MIXTURE` placeholder replaced by ``mixture``'s flags
    (a mixture names its own data, so the data-bin is then empty)."""
    expanded = [f for flag in flags for f in (mixture if flag == MIXTURE else [flag])]
    return ("" if MIXTURE in flags else data_bin), expanded
