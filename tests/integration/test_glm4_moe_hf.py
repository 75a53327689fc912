"""Hugging Face GLM-4.5 checkpoints in and out (``models/glm4_moe/hf.py``): a random tiny Glm4MoeForCausalLM
(partial rotary, QK-norm, q/k/v biases, 8 experts in 2 groups, a shared expert, the first layer dense, a
multi-token prediction layer's tensors) saved by transformers with a tokenizer. ``--from hf`` keeps the tokenizer's
ids and imports the MTP layer as ``--mtp-depth 1`` (DeepSeek-V3's adapter code); the imported model's log-probs
equal transformers' within 1e-4 in fp32; greedy decoding through the KV cache equals ``generate(do_sample=False)``;
``--format hf`` writes the same class back, with transformers' log-probs, tensor for tensor the folder's (the MTP
layer's included)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tests.helpers.hf_glm4_moe import make_hf_glm4_moe  # noqa: E402
from tests.helpers.hf_llama import greedy_pair  # noqa: E402
from tests.helpers.mtp_reference import next_layer_mtp_loss, our_mtp_loss  # noqa: E402
from toolkit.export.api import ExportConfig, run_export  # noqa: E402
from toolkit.inference import load_model  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm4_moe")
    hf = make_hf_glm4_moe(str(root / "hf"))
    run_export(ExportConfig(path=str(root / "hf"), out=str(root / "ours"), import_from="hf"))
    model, task, args = load_model(str(root / "ours" / "model.pt"), str(root / "ours"))
    return dict(root=root, hf=hf, model=model, task=task, args=args)


def batch(n: int = 14) -> torch.Tensor:
    return torch.randint(3, 60, (2, n), generator=torch.Generator().manual_seed(1))


def test_imported_options_ids_and_the_prediction_layer(imported):
    model, d = imported["model"], imported["task"].dictionary
    cfg = model.cfg
    assert imported["args"].arch == "glm4_moe_tiny"
    assert (cfg.decoder_head_dim, cfg.partial_rotary_factor, cfg.qk_norm, cfg.attention_qkv_bias) == (16, 0.5, 1, 1)
    assert (cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_n_group, cfg.moe_topk_group) == (8, 2, 2, 1)
    assert (cfg.first_k_dense_replace, cfg.moe_routed_scaling_factor, cfg.moe_shared_ffn_embed_dim) == (1, 2.5, 16)
    assert not hasattr(model.layers[0].mlp, "experts") and model.layers[1].mlp.experts.gate_proj.shape == (8, 16, 32)
    from safetensors.torch import load_file

    theirs, depth = load_file(str(imported["root"] / "hf" / "model.safetensors")), model.mtp[0]
    assert cfg.mtp_depth == 1 and torch.equal(depth.eh_proj.weight, theirs["model.layers.2.eh_proj.weight"])
    assert torch.equal(depth.layer.self_attn.q_proj.bias, theirs["model.layers.2.self_attn.q_proj.bias"])
    assert torch.equal(depth.layer.mlp.experts.up_proj[3], theirs["model.layers.2.mlp.experts.3.up_proj.weight"])
    assert len(d) == imported["hf"].config.vocab_size and d.eos() == imported["hf"].config.eos_token_id
    tok = transformers.AutoTokenizer.from_pretrained(str(imported["root"] / "ours"))
    ids = tok("w3 w17 w59 w0")["input_ids"]
    assert ids == transformers.AutoTokenizer.from_pretrained(str(imported["root"] / "hf"))("w3 w17 w59 w0")["input_ids"]


def test_the_imported_mtp_layer_computes_the_released_multi_token_prediction(imported):
    """The depth's training loss equals the one transformers' own modules give from the folder's layer 2 as vLLM
    runs GLM-4.5's MTP layer (``tests/helpers/mtp_reference.py``): ``enorm``, ``hnorm``, ``eh_proj``, the block in a
    copy of the MoE layer 1, ``shared_head.norm``, the shared head."""
    x, model = batch(17), imported["model"]
    folder = str(imported["root"] / "hf")
    want = next_layer_mtp_loss(imported["hf"], folder, 2, 1, x[:, :-1], x[:, 1:], model.padding_idx)
    torch.testing.assert_close(our_mtp_loss(model, x[:, :-1], x[:, 1:]), want, rtol=1e-4, atol=1e-5)


def test_log_probs_and_greedy_tokens_equal_transformers(imported):
    x = batch()
    with torch.no_grad():
        ours = imported["model"].get_normalized_probs(imported["model"](x))
        theirs = torch.log_softmax(imported["hf"](x).logits.float(), dim=-1)
    assert (ours - theirs).abs().max().item() < 1e-4
    want, got = greedy_pair(imported["model"], imported["hf"], torch.tensor([[1, 5, 9, 13]]), 10)
    assert got == want


def test_export_back_is_the_same_class_tensors_and_log_probs(imported):
    from safetensors import safe_open

    back = imported["root"] / "back"
    run_export(ExportConfig(path=str(imported["root"] / "ours" / "model.pt"), out=str(back), format="hf"))
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(str(back), dtype=torch.float32).eval()
    assert type(hf2).__name__ == "Glm4MoeForCausalLM"
    assert (
        hf2.config.rope_parameters["partial_rotary_factor"] == 0.5
        and hf2.config.use_qk_norm
        and hf2.config.attention_bias
    )
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(hf2(x).logits, imported["hf"](x).logits, rtol=0, atol=1e-5)
    with (
        safe_open(str(imported["root"] / "hf" / "model.safetensors"), "pt") as a,
        safe_open(str(back / "model.safetensors"), "pt") as b,
    ):
        assert set(b.keys()) == set(a.keys())
        for name in b.keys():
            assert torch.equal(a.get_tensor(name).float(), b.get_tensor(name).float()), name
