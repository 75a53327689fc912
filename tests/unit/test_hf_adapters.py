"""Each rotary family's Hugging Face adapter (``toolkit/models/<family>/hf.py``) round trip, per class it writes:
options -> config.json -> options builds the same model, and state dict -> their tensor names -> state dict gives
the same tensors back, under the names transformers' own model of that config.json has (the dense classes; the
MoE classes' per-expert names are the files' layout, checked by tests/integration/test_moe_hf.py). The folders
themselves (tokenizer, files, logits against transformers) are tests/unit/test_llama_hf.py's and
tests/integration/test_moe_hf.py's.
"""

from __future__ import annotations

import pytest
import torch

from toolkit.core import registry
from toolkit.models import model_config

transformers = pytest.importorskip("transformers")

V = 48
#: case -> (arch, options over the arch's, the model_type its options make the adapter write)
CASES = {
    "llama3-rope": ("llama_tiny_gqa", {}, "llama"),
    "llama-linear-rope": ("llama_tiny", dict(rope_scaling="linear", rope_scaling_factor=4.0), "llama"),
    "llama-yarn": (
        "llama_tiny",
        dict(rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_positions=16),
        "llama",
    ),
    "mistral-window": ("llama_tiny", dict(sliding_window=6), "mistral"),
    "qwen2-biases": ("llama_tiny", dict(attention_qkv_bias=True, share_decoder_input_output_embed=True), "qwen2"),
    "qwen3-local-layer": (
        "qwen3_tiny",
        dict(sliding_window=6, layer_types="full_attention,sliding_attention"),
        "qwen3",
    ),
    "gemma3": ("gemma3_tiny", {}, "gemma3_text"),
    "gemma3-linear-rope": ("gemma3_tiny", dict(rope_scaling="linear", rope_scaling_factor=8.0), "gemma3_text"),
    "olmo2": ("olmo2_tiny", {}, "olmo2"),
    "olmo3-yarn-on-the-global-layer": ("olmo3_tiny", {}, "olmo3"),
    "smollm3-nope-interval": ("smollm3_tiny", {}, "smollm3"),
    "smollm3-nope-list-local-layer": (
        "smollm3_tiny",
        dict(nope_layers="0", sliding_window=6, layer_types="full_attention,sliding_attention"),
        "smollm3",
    ),
    "qwen3-moe": ("moe_tiny", {}, "qwen3_moe"),
    "olmoe": ("olmoe_tiny", {}, "olmoe"),
    "mixtral": ("mixtral_tiny", {}, "mixtral"),
}
DENSE = {"llama", "mistral", "qwen2", "qwen3", "gemma3_text", "olmo2", "olmo3", "smollm3"}


def build(arch: str, **options):
    cfg = model_config(arch, **{"max_target_positions": 32, **options})
    return registry.resolve_arch(arch).cls(cfg, V, padding_idx=1, seed=7).eval()


@pytest.fixture(params=sorted(CASES))
def case(request):
    arch, options, kind = CASES[request.param]
    model = build(arch, **options)
    adapter = type(model).HF_ADAPTER()
    cls_name, config = adapter.hf_config(model.cfg, V)
    return dict(arch=arch, model=model, adapter=adapter, kind=kind, cls_name=cls_name, config=config)


def test_options_to_config_json_and_back_build_the_same_model(case):
    model, adapter = case["model"], case["adapter"]
    assert case["config"]["model_type"] == case["kind"] and case["cls_name"] == adapter.CLASSES[case["kind"]]
    given = adapter.options_from_hf(case["config"], "config.json")
    rebuilt = build(adapter.FAMILY, **given)
    assert type(rebuilt) is type(model)
    differ = {k: (v, getattr(model.cfg, k)) for k, v in given.items() if v != getattr(model.cfg, k)}
    # YaRN's attention factor is written out (its default computed), so it reads back as the number
    assert set(differ) <= {"rope_attention_factor"}, differ
    rebuilt.load_state_dict(model.state_dict())
    tokens = torch.randint(4, V, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(tokens), model(tokens), rtol=0, atol=1e-6)


def test_an_impossible_value_read_back_is_refused_naming_its_key_in_that_config(case):
    """The config.json each class is written as, with its rotary base made 0.5 (toolkit-train's --rope-theta
    refuses it): the import's check names the key where that config keeps it (Gemma 3's and OLMo 3's per layer type, in
    transformers 5's rope_parameters), and Mixtral's expert count by its own key."""
    from toolkit.core.errors import UserError
    from toolkit.models.hf_checkpoint import check_option_values

    adapter, config = case["adapter"], case["config"]
    given = adapter.options_from_hf(config, "config.json")
    options_cls = registry.resolve_arch(case["arch"]).config
    keys = adapter.config_keys(config)
    per_layer_type = case["kind"] in ("gemma3_text", "olmo3")
    theta = "rope_parameters.full_attention.rope_theta" if per_layer_type else "rope_theta"
    with pytest.raises(
        UserError, match=rf"^config.json: {theta} 0.5: must be greater than 1 .*, as for .*--rope-theta;"
    ):
        check_option_values(options_cls, {**given, "rope_theta": 0.5}, "config.json", keys)
    if case["kind"] == "mixtral":
        with pytest.raises(UserError, match=r"^config.json: num_local_experts 0: must be at least 1"):
            check_option_values(options_cls, {**given, "moe_num_experts": 0}, "config.json", keys)


def test_state_dict_to_their_names_and_back(case):
    model, adapter, kind = case["model"], case["adapter"], case["kind"]
    ours = model.state_dict()
    theirs = adapter.state_to_hf(ours, kind)
    if kind in DENSE:  # the names transformers' own model of this config.json holds
        config = transformers.AutoConfig.for_model(
            **{k: v for k, v in case["config"].items() if k != "model_type"}, model_type=kind
        )
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(config)
        saved = set(hf.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())  # tied: one
        assert set(theirs) == saved
    else:  # one tensor per expert and projection
        E, L = model.cfg.moe_num_experts, model.cfg.decoder_layers
        experts = [name for name in theirs if ".experts." in name]
        assert len(experts) == 3 * E * L and len(theirs) == len(ours) - 3 * L + len(experts)
    given = adapter.options_from_hf(case["config"], "config.json")
    back = adapter.state_from_hf(iter(theirs.items()), given, kind)
    assert set(back) == set(ours)
    for name, tensor in ours.items():
        assert torch.equal(back[name], tensor.float()), name


def test_transformers_computes_the_same_logits_from_the_config_and_tensors(case, tmp_path):
    """The config.json and tensors the adapter writes, loaded by transformers (as --format hf's folder is): the
    same log-probabilities within 1e-4 (fp32), positions past the local window and the original context."""
    import json

    from safetensors.torch import save_file

    model, adapter = case["model"], case["adapter"]
    theirs = adapter.state_to_hf(model.state_dict(), case["kind"])
    save_file({k: v.contiguous() for k, v in theirs.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(dict(case["config"], architectures=[case["cls_name"]])))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens = torch.randint(4, V, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = torch.log_softmax(model(tokens).float(), -1)
        want = torch.log_softmax(hf(tokens).logits.float(), -1)
    assert (ours - want).abs().max().item() < 1e-4


def test_a_model_no_class_computes_is_refused_in_one_line():
    from toolkit.core.errors import UserError

    for arch, options in (
        ("llama_tiny", dict(partial_rotary_factor=0.5)),
        ("llama_tiny", dict(mlp_activation="gelu_tanh")),
    ):
        model = build(arch, **options)
        with pytest.raises(UserError) as e:
            model.HF_ADAPTER().hf_config(model.cfg, V)
        assert "nothing written" in str(e.value) and "\n" not in str(e.value)
