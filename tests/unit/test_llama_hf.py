"""Hugging Face checkpoints of the Llama family in and out (toolkit/export/hf_llama.py, models/llama/hf.py).

For random tiny LlamaForCausalLM (GQA, untied, Llama 3 RoPE scaling), Qwen2ForCausalLM (q/k/v
biases, tied, more embedding rows than tokens), Qwen3ForCausalLM (QK-norm, head_dim 32 with width 64 and
4 heads; and with a global then a local layer of window 6), Olmo2ForCausalLM (norms after the sublayers,
QK-norm over the projections), Gemma3ForCausalLM (a local layer of window 6 then a global one, each with its
rotary base, (1 + w) norms around both sublayers, GeGLU, query_pre_attn_scalar, final logit soft-cap) and MistralForCausalLM (no sliding window, and a window of 6 shorter than the texts) folders
saved by transformers with a tokenizer that adds BOS (not Qwen's): ``--from hf`` keeps the
tokenizer's ids (dictionary symbol i is token i), the imported model's log-probs equal
transformers' within 1e-4 in fp32, greedy decoding with the KV cache equals
``generate(do_sample=False)``, and ``--format hf`` writes the same class back with the same log-probs;
``--format safetensors`` reloads exactly; the command refuses a folder without tokenizer.json in one line;
text binarized with the imported tokenizer keeps its ids, continues training from the imported
checkpoint, and the trained model exports back to a folder transformers loads. Their ONNX cache graphs are
tests/integration/test_llama_onnx.py's (the exporter, onnxruntime: the integration tier, as the MoE family's).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tests.helpers.hf_llama import KINDS, WINDOW, greedy_pair, make_hf  # noqa: E402
from toolkit.core.errors import UserError  # noqa: E402
from toolkit.export.api import ExportConfig, run_export  # noqa: E402
from toolkit.inference import load_model  # noqa: E402


@pytest.fixture(scope="module", params=sorted(KINDS))
def imported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = make_hf(str(root / "hf"), request.param)
    run_export(ExportConfig(path=str(root / "hf"), out=str(root / "ours"), import_from="hf"))
    model, task, args = load_model(str(root / "ours" / "model.pt"), str(root / "ours"))
    return dict(kind=request.param, root=root, hf=hf, model=model, task=task, args=args)


def log_probs(model_output) -> torch.Tensor:
    return torch.log_softmax(model_output.float(), dim=-1)


def batch(n: int = 14) -> torch.Tensor:
    return torch.randint(0, 60, (2, n), generator=torch.Generator().manual_seed(1))


def tokenizer(folder):
    """``AutoTokenizer``: the ids promised (for a Qwen2 folder, Qwen2Tokenizer's, not the file's)."""
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def test_token_ids_are_the_tokenizers_own(imported):
    tok = tokenizer(imported["root"] / "ours")
    d = imported["task"].dictionary
    text = "w3 w17 w59 w0"
    ids = tok(text)["input_ids"]
    assert ids == tokenizer(imported["root"] / "hf")(text)["input_ids"]
    assert [d[i] for i in ids] == tok.convert_ids_to_tokens(ids)
    assert len(d) == imported["hf"].config.vocab_size
    assert d.eos() == imported["hf"].config.eos_token_id
    adds_bos = not imported["kind"].startswith("qwen")
    assert (ids[0] == d.bos()) == adds_bos and imported["args"].add_bos_token == adds_bos
    assert d.pad() not in (d.eos(), d.bos()) and d.pad() not in ids


def test_log_probs_equal_transformers(imported):
    x = batch()
    with torch.no_grad():
        ours = imported["model"].get_normalized_probs(imported["model"](x))
        theirs = log_probs(imported["hf"](x).logits)
    assert (ours - theirs).abs().max().item() < 1e-4


def test_greedy_generation_with_the_cache_equals_transformers(imported):
    model, hf = imported["model"], imported["hf"]
    prompt = torch.tensor([[1, 5, 9, 13]]) if not imported["kind"].startswith("qwen") else torch.tensor([[5, 9, 13]])
    want, got = greedy_pair(model, hf, prompt, 12)
    assert got == want


def test_export_back_gives_the_same_class_and_log_probs(imported):
    back = imported["root"] / "back"
    run_export(ExportConfig(path=str(imported["root"] / "ours" / "model.pt"), out=str(back), format="hf"))
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(str(back), dtype=torch.float32).eval()
    assert type(hf2).__name__ == type(imported["hf"]).__name__
    x = batch()
    with torch.no_grad():
        assert (log_probs(hf2(x).logits) - log_probs(imported["hf"](x).logits)).abs().max().item() < 1e-4
    text = "w1 w2 w40"
    assert tokenizer(back)(text)["input_ids"] == tokenizer(imported["root"] / "hf")(text)["input_ids"]


def test_the_imported_options_are_the_classes_own(imported):
    """Each class imports as its family (Gemma 3: the gemma3 family's sandwich blocks; OLMo 2: the olmo2 family's
    norms after the sublayers; the others: the llama family's pre-norm blocks). Qwen3: QK-norm and heads of its
    own size; OLMo 2: QK-norm over the whole projections (q_norm of H x D); Mistral: its window in every layer,
    Qwen3 with use_sliding_window in the layers from max_window_layers on; the texts above are longer than it."""
    from toolkit.models.common.blocks import NormAfterBlock, PreNormBlock, SandwichBlock

    cfg, kind = imported["model"].cfg, imported["kind"]
    family, block = {"gemma3": ("gemma3", SandwichBlock), "olmo2": ("olmo2", NormAfterBlock)}.get(
        kind, ("llama", PreNormBlock)
    )
    assert imported["args"].arch == family and type(imported["model"].layers[0]) is block
    assert cfg.qk_norm == (kind.startswith("qwen3") or kind in ("olmo2", "gemma3"))
    if kind == "gemma3":  # its own norms, GeGLU, score scale, logit cap, local rotary base; a local then a global layer
        assert (cfg.mlp_activation, cfg.query_pre_attn_scalar) == ("gelu_tanh", 24.0)
        assert (cfg.final_logit_softcap, cfg.rope_local_theta, cfg.rope_theta) == (20.0, 1e4, 1e6)
        assert cfg.attn_logit_softcap is None  # Gemma3ForCausalLM ignores attn_logit_softcapping
        assert cfg.layer_types == "sliding_attention,full_attention" and cfg.sliding_window == WINDOW
        return
    assert getattr(cfg, "qk_norm_over", None) == ("projection" if kind == "olmo2" else None)
    assert cfg.decoder_head_dim == (32 if kind.startswith("qwen3") else None)
    assert cfg.sliding_window == (WINDOW if kind.endswith("_window") else None) and WINDOW < len(batch()[0])
    assert cfg.layer_types == ("full_attention,sliding_attention" if kind == "qwen3_window" else None)
    if kind == "olmo2":
        assert imported["model"].layers[0].self_attn.q_norm.weight.shape == (64,)
        assert not hasattr(imported["model"].layers[0], "input_layernorm")
    assert [layer.self_attn.window for layer in imported["model"].layers] == {
        "qwen3_window": [None, WINDOW],
        "mistral_window": [WINDOW, WINDOW],
    }.get(kind, [None, None])


def test_a_window_wider_than_the_context_is_none_and_local_layers_of_a_llama_refused(tmp_path):
    """MistralConfig's default window (4096) is wider than this model's context: every position attends
    to all before it (imported without a window). Qwen2 with use_sliding_window and max_window_layers
    (no layer_types, an older config) makes the layers from there on local. A Llama config naming
    sliding_attention layers asks what LlamaForCausalLM does not compute: refused in one line, nothing written."""
    make_hf(str(tmp_path / "hf"), "mistral")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(dict(config, sliding_window=4096)))
    run_export(ExportConfig(path=str(tmp_path / "hf"), out=str(tmp_path / "wide"), import_from="hf"))
    model, _, _ = load_model(str(tmp_path / "wide" / "model.pt"), str(tmp_path / "wide"))
    assert model.cfg.sliding_window is None
    make_hf(str(tmp_path / "qwen"), "qwen2")
    path = tmp_path / "qwen" / "config.json"
    config = json.loads(path.read_text())
    config.pop("layer_types", None)
    path.write_text(json.dumps(dict(config, use_sliding_window=True, sliding_window=8, max_window_layers=1)))
    run_export(ExportConfig(path=str(tmp_path / "qwen"), out=str(tmp_path / "local"), import_from="hf"))
    model, _, _ = load_model(str(tmp_path / "local" / "model.pt"), str(tmp_path / "local"))
    assert [layer.self_attn.window for layer in model.layers] == [None, 8]
    make_hf(str(tmp_path / "llama"), "llama")
    path = tmp_path / "llama" / "config.json"
    path.write_text(
        json.dumps(
            dict(json.loads(path.read_text()), sliding_window=8, layer_types=["full_attention", "sliding_attention"])
        )
    )
    with pytest.raises(UserError, match=r"config.json: layer_types \['sliding_attention'\] in a LlamaForCausalLM"):
        run_export(ExportConfig(path=str(tmp_path / "llama"), out=str(tmp_path / "out"), import_from="hf"))
    assert not os.path.exists(tmp_path / "out")


def test_safetensors_export_reloads_with_the_same_log_probs(imported):
    out = imported["root"] / "st"
    run_export(ExportConfig(path=str(imported["root"] / "ours" / "model.pt"), out=str(out), format="safetensors"))
    model, task, _ = load_model(str(out / "model.safetensors"))
    assert task.dictionary == imported["task"].dictionary and task.dictionary.bos() == imported["task"].dictionary.bos()
    x = batch()
    with torch.no_grad():
        assert torch.equal(model(x), imported["model"](x))


def test_vocabulary_dictionary_keeps_ids_through_dict_txt(tmp_path):
    from toolkit.data.dictionary import Dictionary

    d = Dictionary.from_vocabulary(["<unk>", "<s>", "</s>", "a", "b"], bos=1, pad=0, eos=2, unk=0)
    d.save(str(tmp_path / "dict.txt"))
    e = Dictionary.load(str(tmp_path / "dict.txt"))
    assert e == d and (e.bos(), e.pad(), e.eos(), e.unk()) == (1, 0, 2, 0)
    assert e.encode_line("a b zz").tolist() == [3, 4, 0, 2]
    with pytest.raises(ValueError, match="'a b' \\(id 1\\) is empty, repeated or holds whitespace"):
        Dictionary.from_vocabulary(["x", "a b"], bos=0, pad=0, eos=0, unk=0)
    (tmp_path / "bad.txt").write_text("#toolkit:vocabulary bos=1 eos=2\na 1\n")
    with pytest.raises(UserError, match="must be '#toolkit:vocabulary bos=I pad=J eos=K unk=L'"):
        Dictionary.load(str(tmp_path / "bad.txt"))


def test_sharded_safetensors_import_like_one_file(tmp_path):
    hf = make_hf(str(tmp_path / "hf"), "mistral")
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "sharded" / name).write_bytes((tmp_path / "hf" / name).read_bytes())
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    run_export(ExportConfig(path=str(tmp_path / "sharded"), out=str(tmp_path / "ours"), import_from="hf"))
    model, _, _ = load_model(str(tmp_path / "ours" / "model.pt"), str(tmp_path / "ours"))
    x = batch()
    with torch.no_grad():
        assert (model.get_normalized_probs(model(x)) - log_probs(hf(x).logits)).abs().max().item() < 1e-4


def test_llama_cached_forward_equals_the_full_forward(imported):
    """The forward decoder_with_past.onnx is exported from, in PyTorch: a prompt pass, then a token at a time;
    the cache holds the key/value heads (GQA: fewer than the query heads)."""
    from toolkit.export.onnx_format import cached_decoder, empty_cache
    from toolkit.models.llama.config import head_dim, kv_heads

    model = imported["model"]
    tokens = batch(12)
    cached = cached_decoder(model)
    with torch.no_grad():
        expected = model(tokens)
        out = cached(tokens[:, :5], *empty_cache(model, 2))
        steps = [out[0]]
        for t in range(5, tokens.size(1)):
            out = cached(tokens[:, t : t + 1], *out[1:])
            steps.append(out[0])
    assert out[1].shape == (2, kv_heads(model.cfg), tokens.size(1), head_dim(model.cfg))
    assert (torch.cat(steps, dim=1) - expected).abs().max().item() < 1e-4  # fp32, another summation order
