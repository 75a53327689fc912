"""toolkit-export asks the model family (toolkit/core/protocols.py), never its class: a plugin family that
provides adapters is imported and exported through them; one that provides none is refused in one line."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from toolkit.core import registry
from toolkit.core.errors import UserError
from toolkit.core.protocols import HFCheckpoint, HFExportable, HFImportable, OnnxCacheExportable
from toolkit.data.dictionary import Dictionary
from toolkit.export.hf_family import import_hf, importing_family
from toolkit.export.hf_format import export_hf
from toolkit.models.llama.model import LlamaLanguageModel
from toolkit.models.transformer_lm import TransformerLanguageModel


class PlainLM(torch.nn.Module):
    """A plugin family's model with no export adapters at all."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)

    def forward(self, tokens):
        return self.embed(tokens)


class ToyImportLM(PlainLM):
    """A plugin family that reads ``model_type: toy`` folders: its weights file becomes our checkpoint."""

    HF_CLASSES = {"toy": "ToyForCausalLM"}

    @classmethod
    def from_hf(cls, folder, config, out_dir, tokens_per_sample, advance):
        advance(f"{folder}: toy")
        state = {"embed.weight": torch.full((config["vocab_size"], 4), 0.5)}
        advance("converted")
        d = Dictionary()
        d.add_symbol("hello")
        ckpt = {"cfg": {"arch": "toy", "tokens_per_sample": tokens_per_sample or 16}, "model": state, "extra_state": {}}
        return HFCheckpoint(
            ckpt,
            d,
            "wrote model.pt and dict.txt",
            "copied notes.txt",
            files={"notes.txt": os.path.join(folder, "notes.txt")},
            log=("toy imported",),
            dictionary_hash=True,
        )


def test_the_two_families_declare_their_adapters():
    for cls in (TransformerLanguageModel, LlamaLanguageModel):
        assert isinstance(cls, HFImportable) and hasattr(cls, "hf_weights")
        assert isinstance(cls, OnnxCacheExportable)
    assert not isinstance(PlainLM(), (HFExportable, OnnxCacheExportable))


def test_kv_cache_of_a_family_without_a_cached_decoder_is_one_line_naming_those_with_one():
    from toolkit.export.onnx_format import cached_decoder

    with pytest.raises(
        UserError,
        match=r"^--kv-cache: decoder_with_past.onnx is written for gemma3 and glm4_moe and gpt_oss and llama and moe and "
        r"olmo2 and olmo3 and smollm3 and transformer_lm models, not PlainLM; export without --kv-cache \(decoder.onnx\)$",
    ):
        cached_decoder(PlainLM())


def test_from_hf_asks_the_registered_family_for_its_model_type(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(registry.MODEL_REGISTRY.entries, "toy", registry.RegistryEntry("toy", ToyImportLM, None))
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "toy", "vocab_size": 6}))
    (src / "notes.txt").write_text("from the hub\n")
    with caplog.at_level("INFO", logger="toolkit.export.hf_import"):
        out = import_hf(str(src), str(tmp_path / "out"), tokens_per_sample=12)
    assert sorted(os.listdir(out)) == ["dict.txt", "model.pt", "notes.txt", "toolkit_export.json"]
    ckpt = torch.load(os.path.join(out, "model.pt"), weights_only=True)
    assert ckpt["cfg"]["tokens_per_sample"] == 12 and ckpt["model"]["embed.weight"].shape == (6, 4)
    assert ckpt["extra_state"]["dictionary_hash"] == Dictionary.load(os.path.join(out, "dict.txt")).symbols_hash()
    assert "toy imported" in [r.getMessage() for r in caplog.records]


def test_from_hf_refuses_a_model_type_no_family_reads_naming_those_read(tmp_path, monkeypatch):
    monkeypatch.setitem(registry.MODEL_REGISTRY.entries, "toy", registry.RegistryEntry("toy", ToyImportLM, None))
    with pytest.raises(UserError, match=r"^x/config.json: model_type 'bert'; --from hf imports ") as e:
        importing_family({"model_type": "bert"}, "x/config.json")
    for name in ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "ToyForCausalLM"):
        assert name in str(e.value)
    assert importing_family({"model_type": "qwen2"}, "x") is LlamaLanguageModel
    assert importing_family({"model_type": "gpt2"}, "x") is TransformerLanguageModel


def test_format_hf_of_a_family_without_adapters_is_one_line_naming_its_formats(tmp_path):
    loaded = SimpleNamespace(model=PlainLM(), dictionary=None, first_symbol=2, data_dir=str(tmp_path))
    with pytest.raises(UserError) as e:
        export_hf(loaded, str(tmp_path / "out"))
    message = str(e.value)
    assert "\n" not in message and "PlainLM" in message and "provides no Hugging Face adapters" in message
    assert "exports as safetensors, onnx; nothing written" in message
    assert not os.path.exists(tmp_path / "out")


def test_export_help_lists_every_class_a_family_imports():
    """`toolkit-export --help` names what --from hf reads without importing torch: the torch-free list equals the
    registered families' ``HF_CLASSES``. and
    ``--quantize``'s choices those the families write (``HF_QUANTIZATIONS``)."""
    from toolkit.config.commands import IMPORTABLE_HF_CLASSES, QUANTIZATIONS
    from toolkit.core import registry

    registry.import_all_components()
    declared, quantizations = set(), set()
    for name in registry.MODEL_REGISTRY.names():
        cls = registry.MODEL_REGISTRY.get(name).cls
        declared |= set(getattr(cls, "HF_CLASSES", {}).values())
        quantizations |= set(getattr(cls, "HF_QUANTIZATIONS", ()))
    assert sorted(IMPORTABLE_HF_CLASSES) == sorted(declared)
    assert sorted(QUANTIZATIONS) == sorted(quantizations) == ["mxfp4"]


def test_quantize_of_another_family_or_format_is_one_line(tmp_path):
    from toolkit import models
    from toolkit.export.api import ExportConfig, run_export

    loaded = SimpleNamespace(model=models.build_on_meta("llama_tiny", 64), dictionary=None, first_symbol=2)
    with pytest.raises(UserError) as e:
        export_hf(loaded, str(tmp_path / "out"), quantize="mxfp4")
    assert str(e.value) == (
        "--quantize mxfp4: written for gpt_oss models (their releases' storage), not LlamaLanguageModel; "
        "export without --quantize (every weight in --dtype); nothing written"
    )
    cfg = ExportConfig(path=str(tmp_path / "x.pt"), out=str(tmp_path / "out"), format="onnx", quantize="mxfp4")
    with pytest.raises(UserError, match=r"^--quantize mxfp4: applies to --format hf only \(not --format onnx\)$"):
        run_export(cfg)
    assert not os.path.exists(tmp_path / "out")
