"""Local data for the harness tasks in this folder, built from the shared WikiText-2 test split.

Nothing is downloaded and nothing is copied into the repository: the sentences are read from
``../shared/data/wikitext-2-mini`` (or ``$TOOLKIT_SHARED_DATA``) when a task is loaded.

- ``toolkit_wiki_cloze`` (multiple choice): a sentence's words but the last four are the context;
  the choices are its own last four words and those of three other sentences.
- ``toolkit_wiki_ppl`` (loglikelihood_rolling): whole sentences, scored for perplexity.
- ``toolkit_wiki_gen`` (generate_until): the first half of a sentence; the answer is the rest up
  to the end of the sentence (stop string " .").
"""

from __future__ import annotations

import os
from typing import List

TAIL = 4
CHOICES = 4


def _data_file() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.environ.get("TOOLKIT_SHARED_DATA") or os.path.join(here, "..", "..", "..", "shared", "data")
    return os.path.join(root, "wikitext-2-mini", "wiki.test.tokens")


def sentences(min_words: int = 10, max_words: int = 28, count: int = 48) -> List[str]:
    """The first ``count`` sentences of the test split with min..max words (headings skipped)."""
    out: List[str] = []
    with open(_data_file(), encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("="):
                continue
            for part in line.split(" . "):
                words = part.split()
                if min_words <= len(words) <= max_words and "<unk>" not in words:
                    out.append(" ".join(words) + " .")
                    if len(out) == count:
                        return out
    return out


def _dataset(rows: List[dict]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_cloze(**kwargs):
    sents = sentences()
    tails = [" ".join(s.split()[-TAIL:]) for s in sents]
    rows = []
    for i, sent in enumerate(sents):
        others = [tails[(i + 7 * k) % len(tails)] for k in range(1, CHOICES)]
        label = i % CHOICES
        choices = others[:label] + [tails[i]] + others[label:]
        rows.append({"context": " ".join(sent.split()[:-TAIL]), "choices": choices, "label": label})
    return _dataset(rows)


def load_ppl(**kwargs):
    return _dataset([{"text": s} for s in sentences(count=24)])


def load_gen(**kwargs):
    rows = []
    for sent in sentences(count=12):
        words = sent.split()
        half = len(words) // 2
        rows.append({"prompt": " ".join(words[:half]), "answer": " ".join(words[half:-1])})
    return _dataset(rows)


def load_words(**kwargs):
    """``toolkit_words_chat``: contexts and choices in the tiny word-level tokenizer's words (w0..w59 of
    ``tests/helpers/hf_llama.py``), for the chat-template parity on its random models."""
    rows = []
    for i in range(12):
        context = " ".join(f"w{(7 * i + 3 * k) % 60}" for k in range(3))
        choices = [f"w{(11 * i + 5 * k) % 60} w{(13 * i + k) % 60}" for k in range(3)]
        rows.append({"context": context, "choices": choices, "label": i % 3})
    return _dataset(rows)
