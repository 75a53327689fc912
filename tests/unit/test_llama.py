"""The Llama family in one process: the named sizes' published parameter counts, the KV cache against
the full forward, rotary positions, generation with and without the cache, FLOPs per token and the
one-line refusals of impossible shapes; Qwen3's sizes against transformers' own count, its QK-norm and
head size, and the sliding window's reach.

Training runs (real text, two ranks, tensor parallelism, resume) are in tests/integration/test_llama.py.
"""

from __future__ import annotations

import pytest
import torch

from toolkit.core.errors import UserError
from toolkit.generation import GenerationConfig, SequenceGenerator
from toolkit.core.registry import resolve_arch
from toolkit.models import count_parameters, model_config
from toolkit.models.accounting import default_vocab_size
from toolkit.models.llama.model import LlamaLanguageModel

PUBLISHED = {  # Hugging Face's safetensors totals of each model (tied embeddings once)
    "llama3_1b": 1_235_814_400,
    "llama3_3b": 3_212_749_824,
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "llama3_405b": 405_853_388_800,
    "llama2_7b": 6_738_415_616,
    "tinyllama_1_1b": 1_100_048_384,
    "qwen2_0_5b": 494_032_768,
    "mistral_7b": 7_241_732_096,
    "qwen3_0_6b": 596_049_920,
    "qwen3_1_7b": 1_720_574_976,
    "qwen3_8b": 8_190_735_360,
    "olmo2_1b": 1_484_916_736,
    "olmo2_7b": 7_298_617_344,
    "gemma3_1b": 999_885_952,
    "gemma3_4b": 3_880_263_168,  # the language model of Gemma 3 4B (no vision tower)
    "olmo3_7b": 7_298_011_136,
    "olmo3_32b": 32_233_522_176,
    "smollm3_3b": 3_075_098_624,
}
#: transformers' Gemma3TextConfig values of the published models
GEMMA3_CONFIGS = {
    "gemma3_1b": dict(
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
    ),
    "gemma3_4b": dict(
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=34,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
    ),
}
#: transformers' Olmo2Config values of the published models (OLMo-2-0425-1B, OLMo-2-1124-7B)
OLMO2_CONFIGS = {
    "olmo2_1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16
    ),
    "olmo2_7b": dict(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32
    ),
}
#: transformers' Qwen3Config values of the published models (config.json on the hub)
QWEN3_CONFIGS = {
    "qwen3_0_6b": dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, intermediate_size=3072, tie_word_embeddings=True
    ),
    "qwen3_1_7b": dict(
        hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, intermediate_size=6144, tie_word_embeddings=True
    ),
    "qwen3_8b": dict(
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        intermediate_size=12288,
        tie_word_embeddings=False,
    ),
}


#: transformers' config class and values of the published OLMo 3 (Olmo-3-1025-7B, Olmo-3-1125-32B) and SmolLM3-3B
REFRESH_CONFIGS = {
    "olmo3_7b": (
        "Olmo3",
        dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32),
    ),
    "olmo3_32b": (
        "Olmo3",
        dict(
            hidden_size=5120,
            intermediate_size=27648,
            num_hidden_layers=64,
            num_attention_heads=40,
            num_key_value_heads=8,
        ),
    ),
    "smollm3_3b": (
        "SmolLM3",
        dict(
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=4,
        ),
    ),
}


@pytest.mark.parametrize("arch", sorted(PUBLISHED))
def test_named_sizes_have_the_published_parameter_counts(arch):
    assert count_parameters(arch, vocab_size=default_vocab_size(arch)) == PUBLISHED[arch]


@pytest.mark.parametrize("arch", sorted(QWEN3_CONFIGS))
def test_qwen3_sizes_count_as_transformers_builds_them(arch):
    """Our model built on the meta device holds as many parameters as transformers' Qwen3ForCausalLM of the
    published config (tied embeddings once)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(vocab_size=151936, num_key_value_heads=8, head_dim=128, **QWEN3_CONFIGS[arch])
    with torch.device("meta"):
        hf = transformers.Qwen3ForCausalLM(config)
    theirs = sum(p.numel() for p in {id(p): p for p in hf.parameters()}.values())
    assert count_parameters(arch, vocab_size=default_vocab_size(arch)) == theirs == PUBLISHED[arch]


@pytest.mark.parametrize("arch", sorted(OLMO2_CONFIGS))
def test_olmo2_sizes_count_as_transformers_builds_them(arch):
    """As for Qwen3: a meta-device Olmo2ForCausalLM of the published config holds as many parameters
    (its q_norm / k_norm span the whole projections, and each block has two norms after its sublayers)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Olmo2Config(vocab_size=100352, tie_word_embeddings=False, **OLMO2_CONFIGS[arch])
    with torch.device("meta"):
        hf = transformers.Olmo2ForCausalLM(config)
    theirs = sum(p.numel() for p in hf.parameters())
    assert count_parameters(arch, vocab_size=default_vocab_size(arch)) == theirs == PUBLISHED[arch]


@pytest.mark.parametrize("arch", sorted(REFRESH_CONFIGS))
def test_olmo3_and_smollm3_sizes_count_as_transformers_builds_them(arch):
    """A meta-device Olmo3ForCausalLM (untied) / SmolLM3ForCausalLM (tied) of the published config holds as many
    parameters (local layers and NoPE layers have the same tensors as the others)."""
    transformers = pytest.importorskip("transformers")
    name, values = REFRESH_CONFIGS[arch]
    config = getattr(transformers, f"{name}Config")(vocab_size=default_vocab_size(arch), **values)
    with torch.device("meta"):
        hf = getattr(transformers, f"{name}ForCausalLM")(config)
    theirs = sum(p.numel() for p in {id(p): p for p in hf.parameters()}.values())
    assert count_parameters(arch, vocab_size=default_vocab_size(arch)) == theirs == PUBLISHED[arch]


@pytest.mark.parametrize("arch", sorted(GEMMA3_CONFIGS))
def test_gemma3_sizes_count_as_transformers_builds_them(arch):
    """A meta-device Gemma3ForCausalLM of the published text config holds as many parameters (tied)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma3TextConfig(vocab_size=default_vocab_size(arch), **GEMMA3_CONFIGS[arch])
    with torch.device("meta"):
        hf = transformers.Gemma3ForCausalLM(config)
    theirs = sum(p.numel() for p in {id(p): p for p in hf.parameters()}.values())
    assert count_parameters(arch, vocab_size=default_vocab_size(arch)) == theirs == PUBLISHED[arch]


def tiny(arch: str = "llama_tiny", vocab: int = 40, seed: int = 1, **overrides) -> LlamaLanguageModel:
    """The family's model of ``arch`` (Llama, OLMo 2, Gemma 3), built and initialized with ``seed``."""
    cfg = model_config(arch, max_target_positions=48, **overrides)
    return resolve_arch(arch).cls(cfg, vocab, padding_idx=1, seed=seed).eval()


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama_tiny", {}),
        ("llama_tiny_gqa", {}),
        ("qwen3_tiny", {}),
        ("olmo2_tiny", {}),
        ("gemma3_tiny", {}),
        ("llama_tiny", dict(sliding_window=6)),
        ("llama_tiny", dict(sliding_window=6, layer_types="sliding_attention,full_attention")),
    ],
)
def test_cache_equals_full_forward_and_holds_kv_heads(arch, overrides):
    model = tiny(arch, attention_qkv_bias=True, **overrides)
    x = torch.randint(4, 40, (3, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(x)
        state = {}
        chunks = [model(x[:, a:b], incremental_state=state) for a, b in [(0, 7), (7, 8), (8, 9), (9, 30)]]
        assert torch.allclose(torch.cat(chunks, 1), full, atol=1e-5)
        assert state["positions"] == 30
        keys, values = state["layers"][0].buffers  # the attention's entries: k and v of the G key/value heads
        assert keys.size(1) == values.size(1) == model.cfg.decoder_kv_heads < model.cfg.decoder_attention_heads
        # a local layer's cache keeps the last window - 1 positions only, a global layer's all of them
        kept = [cache.length for cache in state["layers"]]
        assert kept == [30 if layer.self_attn.window is None else layer.self_attn.window - 1 for layer in model.layers]
        # beam search reorders (and repeats) rows; continuing equals the reordered full forward
        order = torch.tensor([2, 2, 0])
        state = {}
        model(x[:, :10], incremental_state=state)
        model.reorder_incremental_state(state, order)
        assert torch.allclose(model(x[order, 10:], incremental_state=state), model(x[order])[:, 10:], atol=1e-5)


def test_a_sliding_window_hides_what_lies_beyond_it():
    """With --sliding-window 6, position t reads positions t-5..t only: changing position 3 changes the
    outputs at 3..8 (two layers: each widens the reach by 5, so up to 13), none from 14 on; without a
    window every later position changes."""
    x = torch.randint(4, 40, (1, 20), generator=torch.Generator().manual_seed(2))
    y = x.clone()
    y[0, 3] = 4 if x[0, 3] != 4 else 5
    windowed, full = tiny(sliding_window=6), tiny()
    with torch.no_grad():
        changed = (windowed(x) - windowed(y)).abs().amax(-1)[0] > 1e-6
        changed_full = (full(x) - full(y)).abs().amax(-1)[0] > 1e-6
    assert changed[3:14].all() and not changed[14:].any() and not changed[:3].any()
    assert changed_full[3:].all()


def test_layer_types_make_only_the_local_layers_windowed():
    """--layer-types sliding_attention,full_attention: layer 0 reads the last 6 positions, layer 1 all before
    it, so a change at 3 reaches every later position (the global layer), unlike two local layers; the
    same holds with a document mask (one document), which builds each kind's mask once."""
    x = torch.randint(4, 40, (1, 20), generator=torch.Generator().manual_seed(2))
    y = x.clone()
    y[0, 3] = 4 if x[0, 3] != 4 else 5
    mixed = tiny(sliding_window=6, layer_types="sliding_attention,full_attention")
    assert [layer.self_attn.window for layer in mixed.layers] == [6, None]
    one_document = torch.zeros_like(x)
    with torch.no_grad():
        changed = (mixed(x) - mixed(y)).abs().amax(-1)[0] > 1e-6
        assert torch.allclose(mixed(x, document_ids=one_document), mixed(x), atol=1e-5)
        local = tiny(sliding_window=6, layer_types="sliding_attention,sliding_attention")
        assert torch.equal(local(x), tiny(sliding_window=6)(x))
    assert changed[3:].all() and not changed[:3].any()


def test_qwen3_heads_are_their_own_size_with_qk_norm():
    model = tiny("qwen3_tiny")
    attn = model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (4 * 32, 64) and attn.k_proj.weight.shape == (2 * 32, 64)
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (32,)
    assert model.rope_cos.shape == (48, 32)


def test_rotary_positions_matter_and_continue():
    """Without positions a causal model would score a shifted copy the same; RoPE must not."""
    model = tiny()
    x = torch.randint(4, 40, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        alone = model(x[:, 6:])
        state = {}
        model(x[:, :6], incremental_state=state)
        continued = model(x[:, 6:], incremental_state=state)
    assert not torch.allclose(alone, continued, atol=1e-3)
    assert torch.allclose(continued, model(x)[:, 6:], atol=1e-5)


def test_generation_with_and_without_cache_agree():
    from toolkit.data.dictionary import Dictionary

    d = Dictionary()
    for i in range(36):
        d.add_symbol(f"w{i}")
    model = tiny("llama_tiny_gqa", vocab=len(d))
    with torch.no_grad():
        model.embed_tokens.weight.mul_(40.0)  # tied output: a peaked next-token distribution
    prompts = [torch.tensor(p) for p in ([5, 6, 7], [8], [9, 10, 11, 12, 5])]
    for values in (dict(beam=1, max_len_b=12), dict(beam=3, nbest=3, max_len_b=10, lenpen=0.5)):
        cached, recomputed = (
            SequenceGenerator([model], d, GenerationConfig(**values), incremental=inc).generate(prompts)
            for inc in (True, False)
        )
        for a_hypos, b_hypos in zip(cached, recomputed):
            for a, b in zip(a_hypos, b_hypos):
                assert torch.equal(a["tokens"], b["tokens"]), values
                assert torch.allclose(a["positional_scores"], b["positional_scores"], atol=1e-5)


def test_flops_per_token_counts_matmul_weights_and_attention():
    untied, tied = tiny(), tiny("llama_tiny_gqa")
    C, F_, L, V = 64, 128, 2, 40
    per_layer = C * C + 2 * C * 32 + C * C + 3 * C * F_ + 2 * C  # q, k, v (2 heads of 16), o; SwiGLU; norms
    n = L * per_layer + C + C * V  # final norm, output layer (the embedding lookup is not a matmul)
    assert untied.num_matmul_parameters() == n
    assert untied.flops_per_token(32) == 6 * n + 12 * L * C * 32
    assert tied.num_matmul_parameters() == sum(p.numel() for p in tied.parameters())  # the lookup is the output


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(decoder_kv_heads=3), "--decoder-kv-heads 3: must divide --decoder-attention-heads 4"),
        (dict(decoder_attention_heads=5), "--decoder-embed-dim 64: must be divisible by --decoder-attention-heads 5"),
        (dict(decoder_embed_dim=36, decoder_attention_heads=4), "the head size 9 must be even"),
        (dict(decoder_head_dim=9), "--decoder-head-dim 9: must be even for rotary embeddings"),
        (
            dict(sliding_window=6, layer_types="sliding_attention"),
            "--layer-types sliding_attention: give one of full_attention or sliding_attention per layer",
        ),
        (dict(sliding_window=6, layer_types="local,full_attention"), "--layer-types local,full_attention: give one"),
        (dict(layer_types="sliding_attention,full_attention"), "sliding_attention layers need --sliding-window N"),
    ],
)
def test_impossible_shapes_are_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        tiny(**overrides)
