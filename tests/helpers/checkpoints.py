"""Checkpoints made in-process for tests: a randomized one as the trainer writes it, and one damaged on disk.

Random weights (LayerNorm included) make a wrongly mapped tensor visible; the damage flips bytes inside a
record so the zip's CRC no longer matches, which is what a torn copy looks like.
"""

from __future__ import annotations

import os
import struct
import zipfile

import torch

from tests.helpers.lm_fixtures import make_data_bin
from toolkit import options
from toolkit.models import model_config
from toolkit.models.transformer_lm import TransformerLanguageModel

LINES = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "",
    "the mat was red and the dog was blue",
    "cats and dogs sat in the red park",
]
TINY = dict(
    decoder_layers=2,
    decoder_embed_dim=32,
    decoder_ffn_embed_dim=48,
    decoder_attention_heads=4,
    dropout=0.0,
    attention_dropout=0.0,
    decoder_input_dim=32,
    decoder_output_dim=32,
    decoder_normalize_before=True,
)  # not transformer_lm's 512/post
TOKENS_PER_SAMPLE = 16


def make_checkpoint(tmp_path, arch: str = "transformer_lm", data_dir=None, name: str = "ckpt", **overrides):
    """A checkpoint as the trainer writes it (plain cfg dict + state), with every value randomized.

    Random LayerNorm weights and biases (not init's 1/0) make a wrongly mapped tensor visible.
    """
    if data_dir is None:
        data_dir = str(tmp_path / "bin")
        make_data_bin(data_dir, {"train": LINES, "valid": LINES[:2]})
    from toolkit.data.dictionary import Dictionary

    dictionary = Dictionary.load(os.path.join(data_dir, "dict.txt"))
    given = {**TINY, **overrides}
    cfg = {
        "task": "language_modeling",
        "arch": arch,
        "data": data_dir,
        "tokens_per_sample": TOKENS_PER_SAMPLE,
        "sample_break_mode": "none",
        "add_bos_token": False,
        "seed": 1,
        **options.architecture_defaults(arch, given),
    }
    model = TransformerLanguageModel(
        model_config(arch, max_target_positions=TOKENS_PER_SAMPLE, **given), len(dictionary), dictionary.pad(), seed=0
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    path = str(tmp_path / name / "checkpoint_best.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"cfg": cfg, "model": model.state_dict()}, path)
    return path, data_dir


def damage_zip_record(path: str) -> None:
    """Overwrite 4 bytes inside the largest tensor record of a ``torch.save`` zip (its CRC no longer matches)."""
    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        f.seek(info.header_offset + 30 + name_len + extra_len + info.file_size // 2)
        word = f.read(4)
        f.seek(-4, os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in word))


class Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)
