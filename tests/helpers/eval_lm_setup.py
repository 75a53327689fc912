"""A tiny fairseq-layout checkpoint and data-bin for eval-lm, shared by its in-process and CLI tests."""

from __future__ import annotations

import torch

from tests.helpers.fairseq_layout import fairseq_main_checkpoint, model_options, random_fairseq_model, task_options
from tests.helpers.lm_fixtures import make_data_bin

LINES = [
    "the cat sat on the mat",
    "a dog ran",
    "the dog sat",
    "",
    "on a mat the cat ran far away now",
    "cat",
    "the mat sat on a dog",
] * 3
MAX_POS = 40


def make_eval_lm_files(root):
    """A data-bin and a random fairseq checkpoint of its vocabulary under ``root``: (data, path, sd, dictionary)."""
    data = str(root / "data")
    dictionary = make_data_bin(data, {"train": LINES, "test": LINES})
    sd = random_fairseq_model(V=len(dictionary), max_pos=MAX_POS, learned=True, tied=False, seed=3)
    path = str(root / "fairseq.pt")
    torch.save(fairseq_main_checkpoint(sd, model_options(max_pos=MAX_POS), task_options(data, MAX_POS)), path)
    return data, path, sd, dictionary
