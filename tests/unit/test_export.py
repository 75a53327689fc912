"""toolkit-export round trips: safetensors -> hub, ONNX -> onnxruntime, HF both ways (tiny models)."""

from __future__ import annotations

import json
import re
import os
import sys

import pytest
import torch

from tests.helpers.checkpoints import LINES, TOKENS_PER_SAMPLE, make_checkpoint
from tests.helpers.lm_fixtures import make_data_bin
from toolkit.core.errors import UserError
from toolkit.export.api import ExportConfig, run_export
from toolkit.export.safetensors_format import dedupe_shared
from toolkit.inference.hub_utils import from_pretrained


def export(path, fmt, out, **kwargs) -> str:
    return run_export(ExportConfig(path=path, format=fmt, out=str(out), **kwargs))


@pytest.mark.parametrize("overrides", [{}, {"share_decoder_input_output_embed": True, "decoder_learned_pos": True}])
def test_safetensors_folder_loads_in_hub_with_identical_scores(tmp_path, monkeypatch, overrides):
    path, data_dir = make_checkpoint(tmp_path, **overrides)
    out = export(path, "safetensors", tmp_path / "st")
    assert sorted(os.listdir(out)) == ["config.json", "dict.txt", "model.safetensors", "toolkit_export.json"]
    original = from_pretrained(os.path.dirname(path), data_name_or_path=data_dir, device="cpu")
    with monkeypatch.context() as m:
        m.setattr(torch, "load", lambda *a, **k: pytest.fail("the safetensors folder must load without torch.load"))
        exported = from_pretrained(out, device="cpu")
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


def torch_greedy(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    tokens = prompt
    with torch.no_grad():
        for _ in range(steps):
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens


CACHE_CASES = [
    {},  # transformer_lm: sinusoidal, pre-norm, final LayerNorm, untied
    {
        "decoder_learned_pos": True,
        "decoder_normalize_before": False,
        "share_decoder_input_output_embed": True,
        "activation_fn": "gelu",
    },
]


@pytest.mark.parametrize("overrides", CACHE_CASES)
def test_cached_forward_equals_the_full_forward(tmp_path, overrides):
    """The forward the cache graph is exported from, in PyTorch: a prompt pass, then a token at a time."""
    from toolkit.export.onnx_format import CachedDecoder, empty_cache
    from toolkit.inference import load_model

    model, _, _ = load_model(make_checkpoint(tmp_path, **overrides)[0])
    tokens = torch.randint(0, model.embed_tokens.num_embeddings, (2, TOKENS_PER_SAMPLE))
    cached = CachedDecoder(model)
    with torch.no_grad():
        expected = model(tokens)
        out = cached(tokens[:, :5], *empty_cache(model, 2))
        steps = [out[0]]
        for t in range(5, TOKENS_PER_SAMPLE):
            out = cached(tokens[:, t : t + 1], *out[1:])
            steps.append(out[0])
    assert out[1].shape == (2, 4, TOKENS_PER_SAMPLE, 8)  # [B, H, P, D]
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-5, rtol=0)


def test_onnx_logits_and_cached_greedy_match_pytorch(tmp_path):
    pytest.importorskip("onnxruntime")
    import onnx
    from toolkit.export import onnx_format
    from toolkit.inference import load_model

    path, _ = make_checkpoint(tmp_path)
    out = export(path, "onnx", tmp_path / "onnx", kv_cache=True)
    model, _, _ = load_model(path)
    for name in ("decoder.onnx", "decoder_with_past.onnx"):
        graph = onnx.load(os.path.join(out, name))
        onnx.checker.check_model(graph)
        assert max(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")) >= 17
    sess = onnx_format.session(os.path.join(out, "decoder.onnx"))
    g = torch.Generator().manual_seed(3)
    for shape in [(1, 1), (3, 7), (2, TOKENS_PER_SAMPLE)]:
        tokens = torch.randint(0, model.embed_tokens.num_embeddings, shape, generator=g)
        with torch.no_grad():
            expected = model(tokens)
        torch.testing.assert_close(onnx_format.run_logits(sess, tokens), expected, atol=1e-4, rtol=0)
    prompt = torch.randint(4, model.embed_tokens.num_embeddings, (2, 3), generator=g)
    steps = TOKENS_PER_SAMPLE - 3
    cached = onnx_format.session(os.path.join(out, "decoder_with_past.onnx"))
    heads = model.cfg.decoder_attention_heads
    got = onnx_format.greedy_decode(cached, len(model.layers), (heads, 32 // heads), prompt, steps)
    assert torch.equal(got, torch_greedy(model, prompt, steps))


def test_onnx_opset_17_and_missing_packages(tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    import onnx

    path, _ = make_checkpoint(tmp_path)
    out = export(path, "onnx", tmp_path / "onnx17", opset=17)
    graph = onnx.load(os.path.join(out, "decoder.onnx"))
    assert [o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")] == [17]
    with pytest.raises(UserError, match="--opset 16"):
        export(path, "onnx", tmp_path / "onnx16", opset=16)
    with pytest.raises(UserError, match="--dtype bf16"):
        export(path, "onnx", tmp_path / "onnx-bf16", dtype="bf16")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as if not installed
    with pytest.raises(UserError, match=r"pip install toolkit\[export\]"):
        export(path, "onnx", tmp_path / "missing")
    assert not os.path.exists(tmp_path / "missing")


HF_CASES = [  # (class written, model options): each class, tied and untied, every norm placement it takes
    ("xglm", {}),  # transformer_lm's default: sinusoidal, scale √d, pre-norm + final norm, relu
    ("xglm", {"share_decoder_input_output_embed": True, "no_scale_embedding": True, "activation_fn": "gelu"}),
    ("opt", {"decoder_learned_pos": True, "no_scale_embedding": True, "share_decoder_input_output_embed": True}),
    ("opt", {"decoder_learned_pos": True, "decoder_normalize_before": False, "activation_fn": "gelu"}),
    ("opt", {"decoder_learned_pos": True, "no_decoder_final_norm": True, "activation_fn": "gelu_accurate"}),
    (
        "gpt2",
        {
            "decoder_learned_pos": True,
            "no_scale_embedding": True,
            "share_decoder_input_output_embed": True,
            "activation_fn": "gelu",
        },
    ),
    ("gpt2", {"decoder_learned_pos": True}),  # untied: the scale √d folds into the input table exactly
]


def hf_logits(folder: str, tokens: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("hf_class,overrides", HF_CASES)
def test_hf_export_logits_match(tmp_path, hf_class, overrides):
    pytest.importorskip("transformers")
    from toolkit.models.transformer_lm.hf import CLASS_NAMES
    from toolkit.inference import load_model

    path, _ = make_checkpoint(tmp_path, **overrides)
    out = export(path, "hf", tmp_path / "hf", hf_class=hf_class)
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["architectures"] == [CLASS_NAMES[hf_class]]
    assert (config["pad_token_id"], config["eos_token_id"], config["bos_token_id"]) == (1, 2, 2)
    model, _, _ = load_model(path)
    tokens = torch.randint(
        4, model.embed_tokens.num_embeddings, (3, TOKENS_PER_SAMPLE), generator=torch.Generator().manual_seed(5)
    )
    with torch.no_grad():
        expected = model(tokens)
    torch.testing.assert_close(hf_logits(out, tokens), expected, atol=1e-4, rtol=0)


def test_hf_auto_class_picks_xglm_for_sinusoidal_and_opt_for_learned(tmp_path):
    pytest.importorskip("transformers")
    for name, overrides, expected in [
        ("a", {}, "XGLMForCausalLM"),
        ("b", {"decoder_learned_pos": True, "no_scale_embedding": True}, "OPTForCausalLM"),
    ]:
        path, _ = make_checkpoint(tmp_path / name, **overrides)
        out = export(path, "hf", tmp_path / name / "hf")
        assert json.load(open(os.path.join(out, "config.json")))["architectures"] == [expected]


@pytest.mark.parametrize(
    "arch,overrides,hf_class,option",
    [
        ("transformer_lm", {"decoder_normalize_before": False}, "auto", "--no-decoder-normalize-before"),
        ("transformer_lm", {"no_decoder_final_norm": True}, "auto", "--no-decoder-final-norm"),
        ("transformer_lm_gpt3_small", {}, "auto", "--share-decoder-input-output-embed"),  # learned + scale + tied
        ("transformer_lm", {"no_token_positional_embeddings": True}, "auto", "--no-token-positional-embeddings"),
        ("transformer_lm", {"activation_fn": "swish"}, "gpt2", "sinusoidal positions"),
    ],
)
def test_hf_export_refuses_what_no_class_computes(tmp_path, arch, overrides, hf_class, option):
    pytest.importorskip("transformers")
    path, _ = make_checkpoint(tmp_path, arch, **overrides)
    with pytest.raises(UserError, match=re.escape(option)):
        export(path, "hf", tmp_path / "hf", hf_class=hf_class)
    assert not os.path.exists(tmp_path / "hf")


def make_bpe_data_bin(tmp_path, bpe: str, full_dictionary: bool = True) -> str:
    """A data-bin tokenized with a tiny byte-level BPE trained here; ``full_dictionary``: every BPE
    token in dict.txt (as fairseq's GPT-2 dict has), else only the tokens the corpus uses."""
    from tokenizers import ByteLevelBPETokenizer

    from toolkit.tokenizers import build_tokenizer, save_tokenizer_to_data_bin

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(LINES, vocab_size=300, min_frequency=1, show_progress=False, special_tokens=[])
    files = tmp_path / "bpe"
    os.makedirs(files, exist_ok=True)
    if bpe == "gpt2":
        tok.save_model(str(files))
        bpe_cfg = {"gpt2_encoder_json": str(files / "vocab.json"), "gpt2_vocab_bpe": str(files / "merges.txt")}
        vocab = [str(i) for i in range(tok.get_vocab_size())]
    else:
        tok.save(str(files / "tok.json"))
        bpe_cfg = {"bpe_model": str(files / "tok.json")}
        vocab = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    encoder = build_tokenizer(bpe, bpe_cfg)
    encoded = encoder.encode_lines(LINES)
    used = list(dict.fromkeys(p for line in encoded for p in line.split()))
    data_dir = str(tmp_path / f"bin-{bpe}")
    make_data_bin(data_dir, {"train": encoded}, symbols=vocab if full_dictionary else used)
    save_tokenizer_to_data_bin(bpe, bpe_cfg, data_dir)
    return data_dir


@pytest.mark.parametrize("bpe", [None, "hf_byte_bpe", "gpt2"])
def test_hf_tokenizer_gives_the_hub_ids(tmp_path, bpe):
    transformers = pytest.importorskip("transformers")
    data_dir = make_bpe_data_bin(tmp_path, bpe) if bpe else None
    path, data_dir = make_checkpoint(tmp_path, data_dir=data_dir)
    out = export(path, "hf", tmp_path / "hf")
    hub = from_pretrained(os.path.dirname(path), data_name_or_path=data_dir, device="cpu")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    for text in ["the cat sat on the mat", "a red dog, unseen words: zebra!"]:
        ours = hub.encode(text).tolist()  # pieces + </s>; the LM sees </s> first, then the pieces
        assert tokenizer(text)["input_ids"] == [hub.dictionary.eos()] + ours[:-1]
    assert tokenizer.pad_token_id == 1 and tokenizer.eos_token_id == 2


def test_hf_tokenizer_skipped_when_bpe_tokens_are_missing_from_the_dictionary(tmp_path):
    pytest.importorskip("transformers")
    path, _ = make_checkpoint(tmp_path, data_dir=make_bpe_data_bin(tmp_path, "hf_byte_bpe", full_dictionary=False))
    out = export(path, "hf", tmp_path / "hf")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "toolkit_export.json"]


def save_tiny_gpt2(folder, tied: bool = True, **config_overrides):
    """A randomly initialized GPT2LMHeadModel (LayerNorms randomized too) with a tiny trained BPE."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(
        LINES, vocab_size=300, min_frequency=1, show_progress=False, special_tokens=["<|endoftext|>"]
    )
    vocab_size = tok.get_vocab_size()
    eot = tok.token_to_id("<|endoftext|>")
    config = transformers.GPT2Config(
        vocab_size=vocab_size,
        n_positions=TOKENS_PER_SAMPLE,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=eot,
        eos_token_id=eot,
        tie_word_embeddings=tied,
        **config_overrides,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(str(folder))
    tok.save_model(str(folder))  # vocab.json + merges.txt, GPT-2's tokenizer files
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_import_gpt2_logits_match(tmp_path, tied):
    from toolkit.data.dictionary import Dictionary
    from toolkit.inference import load_model

    hf = save_tiny_gpt2(tmp_path / "gpt2", tied=tied)
    out = run_export(ExportConfig(path=str(tmp_path / "gpt2"), import_from="hf", out=str(tmp_path / "imported")))
    assert sorted(os.listdir(out)) == [
        "bpe.json",
        "dict.txt",
        "encoder.json",
        "model.pt",
        "toolkit_export.json",
        "vocab.bpe",
    ]
    model, task, args = load_model(os.path.join(out, "model.pt"))
    d = Dictionary.load(os.path.join(out, "dict.txt"))
    eot = hf.config.eos_token_id
    ours_of = torch.tensor([d.eos() if i == eot else d.index(str(i)) for i in range(hf.config.vocab_size)])
    assert len(set(ours_of.tolist())) == hf.config.vocab_size and d.unk() not in ours_of
    assert args.share_decoder_input_output_embed == tied and args.activation_fn == "gelu_accurate"
    tokens = torch.randint(0, hf.config.vocab_size, (3, TOKENS_PER_SAMPLE), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = model(ours_of[tokens])[:, :, ours_of]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    hub = from_pretrained(out, "model.pt", device="cpu")  # GPT-2's BPE, our dictionary: ids map one to one
    text = "the cat sat on the red mat"
    gpt2_ids = [int(p) for p in hub.bpe.encode(text).split()]
    assert hub.encode(text).tolist() == ours_of[gpt2_ids].tolist() + [d.eos()]


def test_import_refuses_what_the_model_cannot_compute(tmp_path):
    save_tiny_gpt2(tmp_path / "gpt2", layer_norm_epsilon=1e-6)
    with pytest.raises(UserError, match="layer_norm_epsilon"):
        run_export(ExportConfig(path=str(tmp_path / "gpt2"), import_from="hf", out=str(tmp_path / "imported")))
    assert not os.path.exists(tmp_path / "imported")


def test_export_logs_each_step_when_not_on_a_terminal(tmp_path, caplog):
    path, _ = make_checkpoint(tmp_path)
    with caplog.at_level("INFO", logger="toolkit.export"):
        export(path, "safetensors", tmp_path / "st")
    lines = [r.getMessage() for r in caplog.records if r.name == "toolkit.export"]
    for step in ("load [1/1]", "safetensors [1/3]", "safetensors [2/3]", "safetensors [3/3]"):
        assert any(line.startswith(step) for line in lines), lines


def test_hf_export_in_bf16_stores_bf16(tmp_path):
    pytest.importorskip("transformers")
    from safetensors import safe_open

    path, _ = make_checkpoint(tmp_path)
    out = export(path, "hf", tmp_path / "hf", dtype="bf16")
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.load(open(os.path.join(out, "config.json")))["dtype"] == "bfloat16"


def test_safetensors_folder_carries_the_bpe(tmp_path):
    path, data_dir = make_checkpoint(tmp_path, data_dir=make_bpe_data_bin(tmp_path, "hf_byte_bpe"))
    out = export(path, "safetensors", tmp_path / "st")
    assert {"bpe.json", "hf_byte_bpe.json", "dict.txt"} <= set(os.listdir(out))
    original = from_pretrained(os.path.dirname(path), data_name_or_path=data_dir, device="cpu")
    exported = from_pretrained(out, device="cpu")
    text = "the red cat sat in the park"
    assert exported.bpe is not None  # fairseq's name: bpe (subwords), tokenizer (words)
    assert torch.equal(original.score(text)["positional_scores"], exported.score(text)["positional_scores"])
