"""Unigram perplexity of a data-bin split under the train split's token frequencies (add-one smoothed).

The baseline a trained language model must beat by a wide margin.
    python examples/language_model/unigram_ppl.py data-bin/wikitext-2-mini test
"""

import math
import os
import sys

import numpy as np

from toolkit.data.dictionary import Dictionary
from toolkit.data.indexed_dataset import MMapIndexedDataset


def unigram_perplexity(data_dir: str, split: str) -> float:
    vocab = len(Dictionary.load(os.path.join(data_dir, "dict.txt")))
    train = MMapIndexedDataset(os.path.join(data_dir, "train")).tokens
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    target = MMapIndexedDataset(os.path.join(data_dir, split)).tokens
    return math.exp(-logp[target].mean())


if __name__ == "__main__":
    data_dir, split = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "test"
    print(f"unigram perplexity on {split}: {unigram_perplexity(data_dir, split):.2f}")
