"""Tiny chat data-bins for ``--task sft`` tests, written with the toolkit's own chat split writer.

    from tests.helpers.chat import make_chat_data_bin, varied_conversations
    make_chat_data_bin(tmp_path / "bin", {"train": varied_conversations(16), "valid": varied_conversations(4, 1)})

A conversation is ``(ids, mask)``: its token ids and 1 where the token is trained.
"""

from __future__ import annotations

import os
import random
from typing import Dict, List, Sequence, Tuple

import numpy as np

from toolkit.data.dictionary import Dictionary
from toolkit.data.indexed_dataset import best_fitting_dtype
from toolkit.data.sft_dataset import ChatSplitWriter

WORDS = [f"w{i}" for i in range(40)]
Conversation = Tuple[List[int], List[int]]


def varied_conversations(n: int, seed: int = 0, vocab: int = 4 + len(WORDS)) -> List[Conversation]:
    """``n`` conversations of 6 to 24 tokens, each with one trained span: the longer ones train most of their
    tokens, the shorter ones one, so micro-batches (batched by size) hold very different numbers of trained
    tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        size = rng.randint(6, 24)
        ids = [rng.randrange(4, vocab) for _ in range(size)]
        trained = size - 4 if size > 16 else 1
        start = rng.randint(1, size - trained)
        mask = [0] * size
        mask[start : start + trained] = [1] * trained
        out.append((ids, mask))
    return out


def chat_messages(k: int) -> List[Dict[str, str]]:
    """Conversation ``k`` as chat-template messages: a system turn for odd ``k``, then 1 to 3 user/assistant
    exchanges of the words w0..w59 (the test tokenizer's, ``tests/helpers/hf_llama.py``)."""
    words = lambda n, at: " ".join(f"w{(k * 7 + at + i) % 60}" for i in range(n))  # noqa: E731
    turns = [{"role": "system", "content": words(2, 0)}] if k % 2 else []
    for t in range(1 + k % 3):
        turns.append({"role": "user", "content": words(2 + t, 10 * t)})
        turns.append({"role": "assistant", "content": words(1 + (k + t) % 4, 10 * t + 5)})
    return turns


def make_chat_data_bin(dest, splits: Dict[str, Sequence[Conversation]]) -> Dictionary:
    """``dest/dict.txt`` (the 4 specials and ``WORDS``) and each split's tokens and loss mask."""
    dest = str(dest)
    os.makedirs(dest, exist_ok=True)
    dictionary = Dictionary()
    for word in WORDS:
        dictionary.add_symbol(word)
    dictionary.save(os.path.join(dest, "dict.txt"))
    for name, conversations in splits.items():
        writer = ChatSplitWriter(os.path.join(dest, name), best_fitting_dtype(len(dictionary)))
        for ids, mask in conversations:
            writer.add(ids, mask)
        writer.finalize()
    return dictionary


def trained_targets(conversations: Sequence[Conversation]) -> int:
    """The targets the loss counts: trained tokens but each conversation's first (nothing predicts it)."""
    return int(sum(np.asarray(mask[1:]).sum() for _, mask in conversations))
