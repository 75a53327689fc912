"""The Qwen3-Next family (``toolkit.models.qwen3_next``): the published size against transformers' own model built
on the meta device, the layer kinds of ``--full-attention-interval``, a tiny model's documents computed as if each
were alone (the linear layers' state and the full layer's mask both restart), and its one-line refusals; a released
(vision-language) Qwen3.5 folder's config.json and tensor names read as its text model's."""

from __future__ import annotations

import pytest
import torch

from toolkit import models
from toolkit.core.errors import UserError
from toolkit.models.accounting import default_vocab_size
from toolkit.models.qwen3_next.model import Qwen3NextLanguageModel

PUBLISHED = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=5120,
    num_hidden_layers=4,  # of the published 48: each group of four layers is the same (transformers builds slowly)
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=512,
    num_experts_per_tok=10,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    tie_word_embeddings=False,
)


def test_published_size_equals_transformers_model():
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        theirs = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**PUBLISHED))
    vocab = default_vocab_size("qwen3_next_80b_a3b")
    ours = models.build_on_meta("qwen3_next_80b_a3b", vocab, decoder_layers=4)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    assert [type(layer.self_attn).__name__ for layer in ours.layers] == ["GatedDeltaNet"] * 3 + ["GatedAttention"]
    published = models.build_on_meta("qwen3_next_80b_a3b", vocab)
    assert sum(p.numel() for p in published.parameters()) == 79_674_391_296


QWEN3_5_TEXT = dict(  # what every released Qwen3.5 text_config shares; 4 layers of each (transformers builds slowly)
    vocab_size=248320,
    num_hidden_layers=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)
QWEN3_5_PUBLISHED = {  # arch -> (transformers' class prefix, its text_config's own values, layers, our total)
    "qwen3_5_0_8b": (
        "Qwen3_5",
        dict(
            hidden_size=1024,
            intermediate_size=3584,
            num_attention_heads=8,
            num_key_value_heads=2,
            linear_num_value_heads=16,
            tie_word_embeddings=True,
        ),
        24,
        752_393_024,
    ),
    "qwen3_5_2b": (
        "Qwen3_5",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_attention_heads=8,
            num_key_value_heads=2,
            linear_num_value_heads=16,
            tie_word_embeddings=True,
        ),
        24,
        1_881_825_088,
    ),
    "qwen3_5_4b": (
        "Qwen3_5",
        dict(
            hidden_size=2560,
            intermediate_size=9216,
            num_attention_heads=16,
            num_key_value_heads=4,
            linear_num_value_heads=32,
            tie_word_embeddings=True,
        ),
        32,
        4_205_751_296,
    ),
    "qwen3_5_9b": (
        "Qwen3_5",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=16,
            num_key_value_heads=4,
            linear_num_value_heads=32,
            tie_word_embeddings=False,
        ),
        32,
        8_953_803_264,
    ),
    "qwen3_5_27b": (
        "Qwen3_5",
        dict(
            hidden_size=5120,
            intermediate_size=17408,
            num_attention_heads=24,
            num_key_value_heads=4,
            linear_num_value_heads=48,
            tie_word_embeddings=False,
        ),
        64,
        26_895_998_464,
    ),
    "qwen3_5_35b_a3b": (
        "Qwen3_5Moe",
        dict(
            hidden_size=2048,
            num_attention_heads=16,
            num_key_value_heads=2,
            linear_num_value_heads=32,
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            tie_word_embeddings=False,
        ),
        40,
        34_660_610_688,
    ),
    "qwen3_5_122b_a10b": (
        "Qwen3_5Moe",
        dict(
            hidden_size=3072,
            num_attention_heads=32,
            num_key_value_heads=2,
            linear_num_value_heads=64,
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=1024,
            shared_expert_intermediate_size=1024,
            tie_word_embeddings=False,
        ),
        48,
        122_111_526_912,
    ),
    "qwen3_5_397b_a17b": (
        "Qwen3_5Moe",
        dict(
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=2,
            linear_num_value_heads=64,
            num_experts=512,
            num_experts_per_tok=10,
            moe_intermediate_size=1024,
            shared_expert_intermediate_size=1024,
            tie_word_embeddings=False,
        ),
        60,
        396_346_350_336,
    ),
}


@pytest.mark.parametrize("arch", sorted(QWEN3_5_PUBLISHED))
def test_qwen3_5_published_sizes_equal_transformers_models(arch):
    """Each Qwen3.5 size, four of its layers, against transformers' text class of the released config's shapes;
    then the whole size's total (the docstring table's)."""
    transformers = pytest.importorskip("transformers")
    prefix, shapes, layers, total = QWEN3_5_PUBLISHED[arch]
    config = getattr(transformers, f"{prefix}TextConfig")(**QWEN3_5_TEXT, **shapes)
    with torch.device("meta"):
        theirs = getattr(transformers, f"{prefix}ForCausalLM")(config)
    vocab = default_vocab_size(arch)
    ours = models.build_on_meta(arch, vocab, decoder_layers=4)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    assert [type(layer.self_attn).__name__ for layer in ours.layers] == ["GatedDeltaNet"] * 3 + ["GatedAttention"]
    published = models.build_on_meta(arch, vocab)
    assert (len(published.layers), sum(p.numel() for p in published.parameters())) == (layers, total)


def tiny(**overrides):
    torch.manual_seed(0)
    cfg = models.model_config("qwen3_next_tiny", max_target_positions=32, **overrides)
    return Qwen3NextLanguageModel(cfg, 40, padding_idx=1)


def test_documents_are_computed_as_if_alone():
    model = tiny().eval()
    x = torch.randint(4, 40, (1, 24), generator=torch.Generator().manual_seed(0))
    documents = torch.tensor([[0] * 9 + [1] * 15])
    positions = torch.cat([torch.arange(9), torch.arange(15)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(x, document_ids=documents, positions=positions)
        alone = torch.cat([model(x[:, :9]), model(x[:, 9:])], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(linear_num_value_heads=3), "--linear-num-value-heads 3"),
        (dict(moe_shared_ffn_embed_dim=0), "--moe-shared-ffn-embed-dim 0"),
        (dict(sliding_window=8), "--sliding-window"),
    ],
)
def test_impossible_shapes_are_refused_in_one_line(overrides, flag):
    with pytest.raises(UserError, match=flag):
        tiny(**overrides)


def test_linear_layers_constants_are_not_muon_matrices():
    roles = models.build_on_meta("qwen3_next_tiny", 40).parameter_roles()
    assert {roles[f"layers.0.self_attn.{p}"] for p in ("conv1d.weight", "A_log", "dt_bias")} == {"bias"}
    assert roles["layers.0.self_attn.in_proj_qkvz.weight"] == roles["layers.3.self_attn.q_proj.weight"] == "matrix"


RELEASED = dict(  # a released Qwen3.5 config.json's layout: the text model's settings under text_config
    model_type="qwen3_5",
    text_config=dict(
        model_type="qwen3_5_text",
        eos_token_id=None,
        tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, mrope_section=[11, 11, 10]),
    ),
    eos_token_id=7,
    vision_config=dict(depth=1),
)


@pytest.mark.parametrize(
    "top, text, tied",
    [
        (dict(tie_word_embeddings=True), {}, True),
        (dict(tie_word_embeddings=False), dict(tie_word_embeddings=True), False),
        ({}, dict(tie_word_embeddings=True), True),
        ({}, {}, False),
    ],
)
def test_released_folder_config_is_its_text_models(top, text, tied):
    """The top level's ``tie_word_embeddings`` decides (as transformers ties the vision-language class), else the
    text_config's; token ids missing from the text_config are the top level's."""
    from toolkit.models.qwen3_next.hf_vision_language import text_model

    config = {**RELEASED, **top, "text_config": {**RELEASED["text_config"], **text}}
    if not text:
        del config["text_config"]["tie_word_embeddings"]
    out = text_model(config, "config.json")
    assert (out["model_type"], out["tie_word_embeddings"], out["eos_token_id"]) == ("qwen3_5_text", tied, 7)
    assert "vision_config" not in out and text_model(out, "config.json") is out  # a text config is returned as is


@pytest.mark.parametrize(
    "config, key",
    [
        ({**RELEASED, "text_config": None}, "without a text_config"),
        (
            {**RELEASED, "text_config": {"rope_parameters": {"mrope_section": [11, "11", 10]}}},
            "mrope_section",
        ),
        ({**RELEASED, "text_config": {"rope_parameters": {"mrope_section": [32]}}}, "mrope_section"),
    ],
)
def test_released_folder_config_refusals_are_one_line(config, key):
    from toolkit.models.qwen3_next.hf_vision_language import text_model

    with pytest.raises(UserError, match=key) as e:
        text_model(config, "config.json")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("keep_mtp", [False, True])
def test_released_folder_tensors_are_the_text_models(keep_mtp):
    """The text model's tensors renamed from under ``model.language_model.``, the vision tower's left out, the
    multi-token prediction layer's kept only for a model that has one."""
    from toolkit.models.qwen3_next.hf_vision_language import language_tensors

    one = torch.zeros(1)
    names = ["model.language_model.layers.0.mlp.gate.weight", "model.visual.blocks.0.attn.qkv.weight"]
    names += ["lm_head.weight", "mtp.fc.weight"]
    out = [name for name, _ in language_tensors(((n, one) for n in names), keep_mtp=keep_mtp)]
    assert out == ["model.layers.0.mlp.gate.weight", "lm_head.weight"] + (["mtp.fc.weight"] if keep_mtp else [])


def test_mrope_of_text_positions_is_our_rope():
    """transformers' Qwen3.5 text rotary (the releases' sections [11, 11, 10] of the 32 rotated frequencies of a
    256-wide head) gives our tables where a token's temporal, height and width positions are equal (text), and
    other ones where they are not (the check can fail)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    rope = dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10])
    config = transformers.Qwen3_5TextConfig(head_dim=256, max_position_embeddings=32, rope_parameters=rope)
    theirs = Qwen3_5TextRotaryEmbedding(config)
    model = tiny(decoder_head_dim=256, partial_rotary_factor=0.25, rope_theta=1e7)
    positions = torch.arange(32).view(1, 1, 32).expand(3, 1, 32)
    cos, sin = theirs(torch.zeros(1), positions)
    torch.testing.assert_close((cos[0], sin[0]), model.rope_rows(None, 0, 32), rtol=0, atol=1e-6)
    other, _ = theirs(torch.zeros(1), positions * torch.tensor([1, 2, 1]).view(3, 1, 1))  # an image's heights
    assert not torch.allclose(other[0], cos[0])


def test_tensor_parallel_plan_splits_both_token_mixers_by_heads():
    """What toolkit-plan counts 1/M of: the gated DeltaNet layers' projections in (by key-head groups), out
    (row-parallel), ``A_log`` and ``dt_bias`` (by value heads); their convolution taps and gated norm whole; the full
    layer's projections; the experts whole on every tp rank (expert parallelism's)."""
    from toolkit.distributed.tensor_parallel import split_parameters

    model = models.build_on_meta("qwen3_next_tiny", 64, tokens_per_sample=16)
    split = split_parameters(model)
    linear = "layers.0.self_attn"
    deltanet = {f"{linear}.{p}" for p in ("in_proj_qkvz.weight", "in_proj_ba.weight", "A_log", "dt_bias")}
    assert deltanet | {f"{linear}.out_proj.weight"} <= split
    assert not {f"{linear}.conv1d.weight", f"{linear}.norm.weight"} & split
    assert {f"layers.3.self_attn.{p}_proj.weight" for p in "qkvo"} <= split
    assert not any(".mlp." in name for name in split)


def test_export_of_more_than_one_prediction_depth_is_refused():
    """Qwen's checkpoints hold one mtp.fc and its norms for all their MTP layers, ours one per depth: a model of
    --mtp-depth 2 has no Qwen folder (one line, nothing written)."""
    from toolkit.models.qwen3_next.hf import Qwen3NextAdapter

    cfg = models.model_config("qwen3_next_tiny", max_target_positions=32, mtp_depth=2)
    with pytest.raises(UserError, match="--mtp-depth 2: Qwen's checkpoints hold one mtp.fc"):
        Qwen3NextAdapter().hf_config(cfg, 40)
    assert (
        Qwen3NextAdapter().hf_config(models.model_config("qwen3_next_tiny", mtp_depth=1), 40)[1][
            "mtp_num_hidden_layers"
        ]
        == 1
    )
