"""Hugging Face MoE checkpoints in and out (``models/moe/hf.py``): random tiny Qwen3MoeForCausalLM,
OlmoeForCausalLM and MixtralForCausalLM folders (4 experts, top 2) saved by transformers with a tokenizer.
``--from hf`` keeps the tokenizer's ids and stacks the per-expert tensors; the imported model's log-probs equal
transformers' within 1e-4 in fp32; greedy decoding with the KV cache equals ``generate(do_sample=False)``;
``--format hf`` writes the same class back, tensor for tensor the folder transformers saved; ``--format onnx
--kv-cache`` exports and passes the exporter's onnxruntime check."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tests.helpers.hf_llama import greedy_pair  # noqa: E402
from tests.helpers.hf_moe import KINDS, make_hf_moe  # noqa: E402
from toolkit.export.api import ExportConfig, run_export  # noqa: E402
from toolkit.inference import load_model  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=sorted(KINDS))
def imported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = make_hf_moe(str(root / "hf"), request.param)
    run_export(ExportConfig(path=str(root / "hf"), out=str(root / "ours"), import_from="hf"))
    model, task, args = load_model(str(root / "ours" / "model.pt"), str(root / "ours"))
    return dict(kind=request.param, root=root, hf=hf, model=model, task=task, args=args)


def batch(n: int = 14) -> torch.Tensor:
    return torch.randint(3, 60, (2, n), generator=torch.Generator().manual_seed(1))


def test_imported_options_and_ids(imported):
    cfg, d = imported["model"].cfg, imported["task"].dictionary
    assert (cfg.moe_num_experts, cfg.moe_top_k) == (4, 2)
    assert cfg.moe_renormalize == (imported["kind"] != "olmoe")
    assert cfg.qk_norm == (imported["kind"] != "mixtral") and cfg.qk_norm_full_width == (imported["kind"] == "olmoe")
    assert imported["model"].layers[0].mlp.experts.gate_proj.shape == (4, cfg.moe_ffn_embed_dim, 64)
    assert len(d) == imported["hf"].config.vocab_size and d.eos() == imported["hf"].config.eos_token_id
    tok = transformers.AutoTokenizer.from_pretrained(str(imported["root"] / "ours"))
    ids = tok("w3 w17 w59 w0")["input_ids"]
    assert ids == transformers.AutoTokenizer.from_pretrained(str(imported["root"] / "hf"))("w3 w17 w59 w0")["input_ids"]
    assert [d[i] for i in ids] == tok.convert_ids_to_tokens(ids)


def test_log_probs_equal_transformers(imported):
    x = batch()
    with torch.no_grad():
        ours = imported["model"].get_normalized_probs(imported["model"](x))
        theirs = torch.log_softmax(imported["hf"](x).logits.float(), dim=-1)
    assert (ours - theirs).abs().max().item() < 1e-4


def test_greedy_generation_with_the_cache_equals_transformers(imported):
    model, hf = imported["model"], imported["hf"]
    prompt = torch.tensor([[1, 5, 9, 13]]) if imported["kind"] != "qwen3_moe" else torch.tensor([[5, 9, 13]])
    want, got = greedy_pair(model, hf, prompt, 10)
    assert got == want


def test_export_back_is_the_same_class_and_tensors(imported):
    from safetensors import safe_open

    back = imported["root"] / "back"
    run_export(ExportConfig(path=str(imported["root"] / "ours" / "model.pt"), out=str(back), format="hf"))
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(str(back), dtype=torch.float32).eval()
    assert type(hf2).__name__ == type(imported["hf"]).__name__
    x = batch()
    with torch.no_grad():
        assert torch.equal(hf2(x).logits, imported["hf"](x).logits)
    with (
        safe_open(str(imported["root"] / "hf" / "model.safetensors"), "pt") as a,
        safe_open(str(back / "model.safetensors"), "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            assert torch.equal(a.get_tensor(name).float(), b.get_tensor(name).float()), name


def test_onnx_export_with_kv_cache(imported):
    """The exported graphs run every expert on every token (no sort), the unchosen weighted 0: the exporter's own
    check (onnxruntime's logits against PyTorch's sorted dispatch) passes."""
    pytest.importorskip("onnxruntime")
    out = imported["root"] / "onnx"
    run_export(
        ExportConfig(path=str(imported["root"] / "ours" / "model.pt"), out=str(out), format="onnx", kv_cache=True)
    )
    assert (out / "decoder.onnx").exists() and (out / "decoder_with_past.onnx").exists()
