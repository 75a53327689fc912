"""toolkit-export round trips: safetensors -> hub, ONNX -> onnxruntime, HF both ways (tiny models)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.lm_fixtures import make_data_bin
from toolkit import options
from toolkit.errors import UserError
from toolkit.export.api import ExportConfig, run_export
from toolkit.export.safetensors_format import dedupe_shared
from toolkit.hub_utils import from_pretrained
from toolkit.models import model_config
from toolkit.models.transformer_lm import TransformerLanguageModel

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINES = ["the cat sat on the mat", "a dog ran in the park", "", "the mat was red and the dog was blue",
         "cats and dogs sat in the red park"]
TINY = dict(decoder_layers=2, decoder_embed_dim=32, decoder_ffn_embed_dim=48, decoder_attention_heads=4,
            dropout=0.0, attention_dropout=0.0)
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
    cfg = {"task": "language_modeling", "arch": arch, "data": data_dir, "tokens_per_sample": TOKENS_PER_SAMPLE,
           "sample_break_mode": "none", "add_bos_token": False, "seed": 1,
           **options.architecture_defaults(arch, given)}
    model = TransformerLanguageModel(model_config(arch, max_target_positions=TOKENS_PER_SAMPLE, **given),
                                     len(dictionary), dictionary.pad(), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    path = str(tmp_path / name / "checkpoint_best.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"cfg": cfg, "model": model.state_dict()}, path)
    return path, data_dir


def export(path, fmt, out, **kwargs) -> str:
    return run_export(ExportConfig(path=path, format=fmt, out=str(out), **kwargs))


# ---- safetensors -------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [{}, {"share_decoder_input_output_embed": True, "decoder_learned_pos": True}])
def test_safetensors_folder_loads_in_hub_with_identical_scores(tmp_path, overrides):
    path, data_dir = make_checkpoint(tmp_path, **overrides)
    out = export(path, "safetensors", tmp_path / "st")
    assert sorted(os.listdir(out)) == ["config.json", "dict.txt", "model.safetensors"]
    original = from_pretrained(os.path.dirname(path), data_name_or_path=data_dir, device="cpu")
    exported = from_pretrained(out, device="cpu")  # no .pt in the folder: nothing is unpickled
    for sentence in ["the cat sat on the mat", "a red dog ran in the blue park"]:
        a, b = original.score(sentence), exported.score(sentence)
        assert torch.equal(a["tokens"], b["tokens"])
        assert torch.equal(a["positional_scores"], b["positional_scores"])
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["model"]["decoder_embed_dim"] == 32 and config["dictionary"]["pad"] == 1


def test_safetensors_half_precision_stores_half_and_scores_close(tmp_path):
    from safetensors import safe_open

    path, data_dir = make_checkpoint(tmp_path)
    out = export(path, "safetensors", tmp_path / "st", dtype="bf16")
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    a = from_pretrained(os.path.dirname(path), data_name_or_path=data_dir, device="cpu").score("the cat sat")
    b = from_pretrained(out, device="cpu").score("the cat sat")
    torch.testing.assert_close(a["positional_scores"], b["positional_scores"], atol=0.1, rtol=0)


def test_shared_tensors_are_written_once():
    w = torch.randn(5, 3)
    kept, aliases = dedupe_shared({"embed.weight": w, "head.weight": w, "other": w.clone()})
    assert list(kept) == ["embed.weight", "other"] and aliases == {"head.weight": "embed.weight"}
