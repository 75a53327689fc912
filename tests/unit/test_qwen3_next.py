"""The Qwen3-Next family (``toolkit.models.qwen3_next``): the published size against transformers' own model built
on the meta device, the layer kinds of ``--full-attention-interval``, a tiny model's documents computed as if each
were alone (the linear layers' state and the full layer's mask both restart), and its one-line refusals."""

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
