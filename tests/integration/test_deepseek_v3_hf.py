"""Hugging Face DeepSeek-V3 checkpoints in and out (``models/deepseek_v3/hf.py``): a random tiny
DeepseekV3ForCausalLM (the query low rank, latent attention, 8 experts in 2 groups, a shared expert, the first layer
dense, YaRN with DeepSeek's mscale, interleaved rotary rows) saved by transformers with a tokenizer. ``--from hf``
keeps the tokenizer's ids; the imported model's log-probs equal transformers' within 1e-4 in fp32; greedy decoding
through the latent cache equals ``generate(do_sample=False)``; ``--format hf`` writes the same class back, tensor for
tensor the folder transformers saved, with the same log-probs. The folder holds a multi-token prediction layer as
DeepSeek's checkpoints do (``num_nextn_predict_layers`` 1): imported as ``--mtp-depth 1`` and written back, tensor
for tensor; without its tensors the import leaves it out in one line."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tests.helpers.hf_deepseek import make_hf_deepseek  # noqa: E402
from tests.helpers.hf_llama import greedy_pair  # noqa: E402
from tests.helpers.mtp_reference import next_layer_mtp_loss, our_mtp_loss  # noqa: E402
from toolkit.export.api import ExportConfig, run_export  # noqa: E402
from toolkit.inference import load_model  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_v3")
    hf = make_hf_deepseek(str(root / "hf"), mtp_layers=1)
    run_export(ExportConfig(path=str(root / "hf"), out=str(root / "ours"), import_from="hf"))
    model, task, args = load_model(str(root / "ours" / "model.pt"), str(root / "ours"))
    return dict(root=root, hf=hf, model=model, task=task, args=args)


def batch(n: int = 14) -> torch.Tensor:
    return torch.randint(3, 60, (2, n), generator=torch.Generator().manual_seed(1))


def test_imported_options_and_ids(imported):
    model, d = imported["model"], imported["task"].dictionary
    cfg = model.cfg
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.decoder_head_dim, cfg.qk_nope_head_dim) == (24, 16, 8, 16)
    assert (cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_n_group, cfg.moe_topk_group) == (8, 2, 2, 1)
    assert (cfg.first_k_dense_replace, cfg.moe_routed_scaling_factor, cfg.rope_mscale_all_dim) == (1, 2.5, 1.0)
    assert not hasattr(model.layers[0].mlp, "experts") and model.layers[1].mlp.experts.gate_proj.shape == (8, 32, 64)
    assert len(d) == imported["hf"].config.vocab_size and d.eos() == imported["hf"].config.eos_token_id
    tok = transformers.AutoTokenizer.from_pretrained(str(imported["root"] / "ours"))
    ids = tok("w3 w17 w59 w0")["input_ids"]
    assert ids == transformers.AutoTokenizer.from_pretrained(str(imported["root"] / "hf"))("w3 w17 w59 w0")["input_ids"]


def test_multi_token_prediction_layer_is_imported(imported):
    """The folder's layer 3 (after num_hidden_layers 3) is depth 0: its own tensors, its block's (experts stacked),
    equal to the folder's; the copies of the embedding and the head are the model's own."""
    from safetensors.torch import load_file

    theirs, depth = load_file(str(imported["root"] / "hf" / "model.safetensors")), imported["model"].mtp[0]
    assert imported["model"].cfg.mtp_depth == 1
    for ours, name in [(depth.eh_proj, "eh_proj"), (depth.enorm, "enorm"), (depth.norm, "shared_head.norm")]:
        assert torch.equal(ours.weight, theirs[f"model.layers.3.{name}.weight"]), name
    assert torch.equal(depth.layer.mlp.experts.down_proj[5], theirs["model.layers.3.mlp.experts.5.down_proj.weight"])
    bias = theirs["model.layers.3.mlp.gate.e_score_correction_bias"]
    assert torch.equal(depth.layer.mlp.gate.expert_bias, bias)


def test_a_folder_naming_mtp_layers_without_their_tensors_imports_without_them(imported, tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "hf"
    shutil.copytree(imported["root"] / "hf", folder)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file(
        {k: v for k, v in tensors.items() if not k.startswith("model.layers.3.")}, str(folder / "model.safetensors")
    )
    with caplog.at_level(logging.WARNING):
        run_export(ExportConfig(path=str(folder), out=str(tmp_path / "ours"), import_from="hf"))
    lines = [r.getMessage() for r in caplog.records if "num_nextn_predict_layers" in r.getMessage()]
    assert len(lines) == 1 and "imported without multi-token prediction" in lines[0]
    saved = torch.load(tmp_path / "ours" / "model.pt", map_location="cpu", weights_only=True)
    assert not any(k.startswith("mtp.") for k in saved["model"])


def test_the_imported_mtp_layer_computes_the_released_multi_token_prediction(imported):
    """The depth's training loss equals the one transformers' own modules give from the folder's layer 3 as vLLM
    runs DeepSeek-V3's MTP layer (``tests/helpers/mtp_reference.py``): ``enorm``, ``hnorm``, ``eh_proj``, the block in a
    copy of the MoE layer 2, ``shared_head.norm``, the shared head."""
    x, model = batch(17), imported["model"]
    folder = str(imported["root"] / "hf")
    want = next_layer_mtp_loss(imported["hf"], folder, 3, 2, x[:, :-1], x[:, 1:], model.padding_idx)
    torch.testing.assert_close(our_mtp_loss(model, x[:, :-1], x[:, 1:]), want, rtol=1e-4, atol=1e-5)


def test_log_probs_equal_transformers(imported):
    x = batch()
    with torch.no_grad():
        ours = imported["model"].get_normalized_probs(imported["model"](x))
        theirs = torch.log_softmax(imported["hf"](x).logits.float(), dim=-1)
    assert (ours - theirs).abs().max().item() < 1e-4


def test_greedy_generation_through_the_latent_cache_equals_transformers(imported):
    want, got = greedy_pair(imported["model"], imported["hf"], torch.tensor([[1, 5, 9, 13]]), 10)
    assert got == want


def test_export_back_is_the_same_class_tensors_and_log_probs(imported):
    from safetensors import safe_open

    back = imported["root"] / "back"
    run_export(ExportConfig(path=str(imported["root"] / "ours" / "model.pt"), out=str(back), format="hf"))
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(str(back), dtype=torch.float32).eval()
    assert type(hf2).__name__ == "DeepseekV3ForCausalLM"
    x = batch()
    with torch.no_grad():
        torch.testing.assert_close(hf2(x).logits, imported["hf"](x).logits, rtol=0, atol=1e-5)
    with (
        safe_open(str(imported["root"] / "hf" / "model.safetensors"), "pt") as a,
        safe_open(str(back / "model.safetensors"), "pt") as b,
    ):
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            assert torch.equal(a.get_tensor(name).float(), b.get_tensor(name).float()), name
