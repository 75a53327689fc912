"""Hugging Face gpt-oss checkpoints in and out (``models/gpt_oss/hf.py``): a random tiny GptOssForCausalLM (sinks,
biases everywhere, a local layer of window 4 then a global one, 4 experts of the clamped SwiGLU, YaRN unrounded)
saved by transformers with a harmony-style tokenizer (byte-level BPE, the format's markers as special tokens), and
the same model as the release stores it (MXFP4 experts).

``--from hf`` keeps the tokenizer's ids; the imported model's log-probs equal transformers' within 1e-4 in fp32 on
14 tokens (past the window), for the MXFP4 folder against transformers' own dequantization of it
(``Mxfp4Config(dequantize=True)``); greedy decoding through the KV cache equals ``generate(do_sample=False)``;
``--format hf`` writes the same class back with the same log-probs (tensor for tensor the folder transformers
saved), and an MXFP4 import exported as bf16 holds the dequantized experts exactly (FP4 times a power of two is a
bf16 number); with ``--quantize mxfp4`` it is written as the release stores it: the blocks and scales byte for byte
those of the folder imported, the other tensors in ``--dtype``, transformers' log-probs of it those of the folder."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tests.helpers.hf_gpt_oss import make_hf_gpt_oss, save_mxfp4  # noqa: E402
from tests.helpers.hf_llama import greedy_pair  # noqa: E402
from toolkit.export.api import ExportConfig, run_export  # noqa: E402
from toolkit.inference import load_model  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    hf = make_hf_gpt_oss(str(root / "hf"))
    save_mxfp4(hf, str(root / "mxfp4"))
    return root, hf


@pytest.fixture(scope="module", params=["hf", "mxfp4"])
def imported(request, saved):
    root, hf = saved
    folder, out = root / request.param, root / f"ours_{request.param}"
    if request.param == "mxfp4":
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
        ).eval()
    run_export(ExportConfig(path=str(folder), out=str(out), import_from="hf"))
    model, task, args = load_model(str(out / "model.pt"), str(out))
    return dict(kind=request.param, root=root, folder=folder, out=out, hf=hf, model=model, task=task)


def batch(n: int = 14) -> torch.Tensor:
    return torch.randint(3, 60, (2, n), generator=torch.Generator().manual_seed(1))


def test_imported_options_and_ids(imported):
    cfg, d = imported["model"].cfg, imported["task"].dictionary
    assert (cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_ffn_embed_dim, cfg.moe_swiglu_limit) == (4, 2, 32, 2.0)
    assert (cfg.sliding_window, cfg.layer_types) == (4, "sliding_attention,full_attention")
    assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_yarn_truncate) == ("yarn", 4.0, False)
    assert imported["model"].layers[0].self_attn.sinks.shape == (4,)
    assert len(d) == imported["hf"].config.vocab_size and d.eos() == imported["hf"].config.eos_token_id
    text = "<|start|>user<|message|>w3 w17 w59 w0<|end|><|start|>assistant<|channel|>final<|message|>w12<|return|>"
    ids = transformers.AutoTokenizer.from_pretrained(str(imported["out"]))(text)["input_ids"]
    assert ids == transformers.AutoTokenizer.from_pretrained(str(imported["folder"]))(text)["input_ids"]
    assert d[ids[0]] == "<|start|>" and d[ids[-1]] == "<|return|>" and ids[-1] == d.eos()


def test_log_probs_equal_transformers(imported):
    x = batch()
    with torch.no_grad():
        ours = imported["model"].get_normalized_probs(imported["model"](x))
        theirs = torch.log_softmax(imported["hf"](x).logits.float(), dim=-1)
    assert (ours - theirs).abs().max().item() < 1e-4


@pytest.mark.parametrize("imported", ["hf"], indirect=True)  # the MXFP4 import decodes with the same code
def test_greedy_generation_with_the_cache_equals_transformers(imported):
    want, got = greedy_pair(imported["model"], imported["hf"], torch.tensor([[1, 5, 9, 13]]), 10)
    assert got == want


def stored(folder) -> dict:
    """The tensors of a folder's model.safetensors, by name."""
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_export_back_is_the_same_class_and_log_probs(imported):
    back = imported["root"] / f"back_{imported['kind']}"
    dtype = "bf16" if imported["kind"] == "mxfp4" else "fp32"
    run_export(ExportConfig(path=str(imported["out"] / "model.pt"), out=str(back), format="hf", dtype=dtype))
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(str(back), dtype=torch.float32).eval()
    assert type(hf2).__name__ == "GptOssForCausalLM" and "quantization_config" not in hf2.config.to_dict()
    theirs = imported["hf"].state_dict()
    if dtype == "bf16":  # the dequantized experts are bf16 numbers: written exactly
        for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
            assert torch.equal(hf2.state_dict()[name], theirs[name]), name
        return
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(hf2(x).logits, imported["hf"](x).logits, rtol=0, atol=1e-5)
    theirs, ours = stored(imported["folder"]), stored(back)
    assert set(theirs) == set(ours)
    for name, tensor in theirs.items():
        assert torch.equal(tensor, ours[name]), name


@pytest.mark.parametrize("imported", ["mxfp4"], indirect=True)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_mxfp4_export_holds_the_folders_blocks_and_scales(imported, dtype):
    """``--quantize mxfp4``: the experts as the release stores them (uint8, the bytes of the folder imported), the
    release's quantization_config, every other tensor in --dtype; in fp32 tensor for tensor the folder, and
    transformers' dequantized load of it gives the log-probs of the folder's."""
    from tests.helpers.hf_gpt_oss import MXFP4_CONFIG

    back = imported["root"] / f"back_quantized_{dtype}"
    model_pt = str(imported["out"] / "model.pt")
    run_export(ExportConfig(path=model_pt, out=str(back), format="hf", dtype=dtype, quantize="mxfp4"))
    config = json.loads((back / "config.json").read_text())
    assert config["quantization_config"] == MXFP4_CONFIG
    theirs, ours = stored(imported["folder"]), stored(back)
    assert set(theirs) == set(ours)
    for name, tensor in theirs.items():
        if not name.endswith(("_blocks", "_scales")):  # the others in --dtype
            tensor = tensor.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    assert ours["model.layers.1.mlp.experts.down_proj_blocks"].dtype == torch.uint8
    if dtype == "bf16":
        return
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(
        str(back), quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    x = batch()
    with torch.no_grad():
        got = torch.log_softmax(hf2(x).logits.float(), dim=-1)
        want = torch.log_softmax(imported["hf"](x).logits.float(), dim=-1)
    assert (got - want).abs().max().item() < 1e-4
