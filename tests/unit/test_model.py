"""transformer_lm: shapes, causality, tying, named architectures, deterministic (meta/sharded) init."""

import argparse
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.models import PAD, VOCAB, tiny_cfg, tiny_model, tokens
from toolkit import options
from toolkit.core import registry
from toolkit.models import build_on_meta, count_parameters, model_config
from toolkit.models.init import canonical_name, init_weights
from toolkit.models.transformer_lm import (
    TransformerBlock,
    TransformerLanguageModel,
    TransformerLMConfig,
    flops_per_token,
    sinusoidal_table,
)

POSITION_KINDS = {
    "sinusoidal": {},
    "learned": {"decoder_learned_pos": True},
    "none": {"no_token_positional_embeddings": True},
}


@pytest.mark.parametrize("kind", sorted(POSITION_KINDS))
@pytest.mark.parametrize("normalize_before", [True, False])
def test_forward_shape_and_backward(kind, normalize_before):
    model = tiny_model(decoder_normalize_before=normalize_before, **POSITION_KINDS[kind])
    x = tokens(B=3, T=11)
    logits = model(x)
    assert logits.shape == (3, 11, VOCAB) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert isinstance(model.layers, torch.nn.ModuleList)
    assert all(isinstance(layer, TransformerBlock) for layer in model.layers)
    assert (model.layer_norm is not None) == normalize_before


@pytest.mark.parametrize("kind", sorted(POSITION_KINDS))
def test_causal_future_tokens_do_not_change_earlier_logits(kind):
    model = tiny_model(**POSITION_KINDS[kind]).eval()
    x = tokens(B=2, T=12)
    y = x.clone()
    y[:, 7:] = torch.randint(PAD + 1, VOCAB, (2, 5))
    y[1, 9:] = PAD  # right padding is just another future token
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_positions_matter_and_none_is_permutation_equivariant_only_without_them():
    x = tokens(B=1, T=8)
    swapped = x.clone()
    swapped[0, [0, 1]] = x[0, [1, 0]]
    for kind in ("sinusoidal", "learned"):
        model = tiny_model(**POSITION_KINDS[kind]).eval()
        assert not torch.allclose(model(x)[0, 2:], model(swapped)[0, 2:])
    model = tiny_model(decoder_layers=1, **POSITION_KINDS["none"]).eval()
    # one layer, no positions: from position 2 on, the same query attends to the same set of tokens
    torch.testing.assert_close(model(x)[0, 2:], model(swapped)[0, 2:], rtol=1e-4, atol=1e-5)


def test_sinusoidal_table_matches_fairseq_formula():
    table = sinusoidal_table(num_positions=5, dim=6, first_position=PAD + 1)
    half = 3
    freq = [math.exp(-i * math.log(10000.0) / (half - 1)) for i in range(half)]
    for row in range(5):
        pos = PAD + 1 + row
        expected = [math.sin(pos * f) for f in freq] + [math.cos(pos * f) for f in freq]
        torch.testing.assert_close(table[row], torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert sinusoidal_table(3, 7, 2).shape == (3, 7)
    model = tiny_model()
    torch.testing.assert_close(model.sinusoidal_positions, sinusoidal_table(16, 32, PAD + 1))
    assert "sinusoidal_positions" not in model.state_dict()  # recomputed, never saved


def test_too_long_input_is_rejected():
    with pytest.raises(ValueError, match="max_target_positions"):
        tiny_model()(tokens(B=1, T=17))


def test_embedding_scale_and_padding_row():
    model = tiny_model()
    assert model.embed_scale == pytest.approx(math.sqrt(32))
    assert tiny_model(no_scale_embedding=True).embed_scale == 1.0
    assert torch.count_nonzero(model.embed_tokens.weight[PAD]) == 0
    assert model.embed_tokens.padding_idx == PAD


def test_tied_output_projection_is_the_embedding():
    tied = tiny_model(share_decoder_input_output_embed=True).eval()
    untied = tiny_model(share_decoder_input_output_embed=False).eval()
    assert tied.output_projection is None and untied.output_projection is not None
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == VOCAB * 32
    assert "output_projection.weight" not in tied.state_dict()

    features = {}
    tied.layer_norm.register_forward_hook(lambda m, i, o: features.setdefault("x", o))
    logits = tied(tokens())
    torch.testing.assert_close(logits, features["x"] @ tied.embed_tokens.weight.T)
    # both uses of the shared weight feed its gradient
    logits[..., 5].sum().backward()
    assert torch.count_nonzero(tied.embed_tokens.weight.grad[5]) > 0


GPT3_PUBLISHED = {
    "transformer_lm_gpt3_small": 125e6,
    "transformer_lm_gpt3_medium": 350e6,
    "transformer_lm_gpt3_large": 760e6,
    "transformer_lm_gpt3_xl": 1.3e9,
    "transformer_lm_gpt3_2_7": 2.7e9,
    "transformer_lm_gpt3_6_7": 6.7e9,
    "transformer_lm_gpt3_13": 13e9,
    "transformer_lm_gpt3_175": 175e9,
}
EXPECTED_ARCHS = {
    "transformer_lm",
    "transformer_lm_gpt",
    "transformer_lm_gpt2_small",
    "transformer_lm_gpt2_medium",
    "transformer_lm_gpt2_big",
    *GPT3_PUBLISHED,
}


def test_all_named_architectures_registered_and_build_on_meta():
    registry.import_submodules("toolkit.models")
    names = set(registry.architecture_names())
    assert EXPECTED_ARCHS <= names
    for arch in sorted(names):
        if registry.ARCH_MODEL_NAME[arch] != "transformer_lm":
            continue
        vocab = 267744 if "wiki103" in arch else 50257  # wiki103's adaptive bands end at 60000
        model = build_on_meta(arch, vocab_size=vocab, tokens_per_sample=2048)
        assert all(p.is_meta for p in model.parameters())
        assert model.max_positions() == 2048


@pytest.mark.parametrize("arch,published", sorted(GPT3_PUBLISHED.items()))
def test_gpt3_parameter_counts_match_published(arch, published):
    n = count_parameters(arch, vocab_size=50257, tokens_per_sample=2048)
    assert abs(n - published) / published < 0.05, f"{arch}: {n:,}"


def test_architecture_values_follow_fairseq():
    c = model_config("transformer_lm_gpt3_175")
    assert (c.decoder_layers, c.decoder_embed_dim, c.decoder_attention_heads, c.decoder_ffn_embed_dim) == (
        96,
        12288,
        96,
        4 * 12288,
    )
    assert c.decoder_learned_pos and c.share_decoder_input_output_embed and c.decoder_normalize_before
    assert (c.dropout, c.attention_dropout, c.activation_fn) == (0.0, 0.0, "gelu")
    c = model_config("transformer_lm_gpt2_big")
    assert (c.decoder_layers, c.decoder_embed_dim, c.decoder_attention_heads, c.decoder_ffn_embed_dim) == (
        48,
        1600,
        25,
        6400,
    )
    assert not c.decoder_learned_pos and not c.share_decoder_input_output_embed
    assert (c.dropout, c.attention_dropout, c.activation_fn) == (0.1, 0.1, "gelu")
    c = model_config("transformer_lm")
    assert (c.decoder_layers, c.decoder_embed_dim, c.decoder_ffn_embed_dim, c.decoder_attention_heads) == (
        6,
        512,
        2048,
        8,
    )
    # fairseq >= 0.11: --arch transformer_lm is the config's defaults, post-norm with 512-wide in/out embeddings
    assert (c.activation_fn, c.dropout, c.decoder_normalize_before) == ("relu", 0.1, False)
    assert (c.decoder_input_dim, c.decoder_output_dim) == (512, 512)


def test_user_flags_override_architecture_values():
    registry.import_submodules("toolkit.models")
    parser = argparse.ArgumentParser()
    options.add_dataclass_options(parser, TransformerLMConfig)
    parser.set_defaults(**options.architecture_defaults("transformer_lm_gpt3_small"))
    args = parser.parse_args(["--decoder-layers", "3", "--dropout", "0.2", "--activation-fn", "relu"])
    cfg = options.config_from_args(TransformerLMConfig, args)
    assert (cfg.decoder_layers, cfg.dropout, cfg.activation_fn) == (3, 0.2, "relu")
    assert cfg.decoder_embed_dim == 768 and cfg.decoder_learned_pos  # the arch's other values stay
    args = parser.parse_args([])
    assert options.config_from_args(TransformerLMConfig, args).decoder_layers == 12

    defaults = options.architecture_defaults("transformer_lm_gpt3_small")
    cfg = TransformerLMConfig(
        **{
            **defaults,
            "decoder_embed_dim": 64,
            "decoder_attention_heads": 2,
            "decoder_ffn_embed_dim": 128,
            "decoder_layers": 1,
        }
    )
    assert count_parameters(
        "transformer_lm_gpt3_small",
        vocab_size=100,
        tokens_per_sample=8,
        decoder_embed_dim=64,
        decoder_attention_heads=2,
        decoder_ffn_embed_dim=128,
        decoder_layers=1,
    ) == sum(
        p.numel()
        for p in TransformerLanguageModel(dataclasses.replace(cfg, max_target_positions=8), 100, 1).parameters()
    )


def test_build_model_takes_sizes_from_the_task():
    class Dictionary:
        def __len__(self):
            return 50

        def pad(self):
            return 1

    task = SimpleNamespace(dictionary=Dictionary(), cfg=SimpleNamespace(tokens_per_sample=24))
    model = TransformerLanguageModel.build_model(tiny_cfg(max_target_positions=None, decoder_learned_pos=True), task)
    assert model.max_positions() == 24
    assert model.embed_tokens.weight.shape == (50, 32)
    assert model.embed_positions.weight.shape == (24 + 1 + 1, 32)  # fairseq's table size
    assert model(torch.randint(2, 50, (2, 24))).shape == (2, 24, 50)
    model = TransformerLanguageModel.build_model(tiny_cfg(max_target_positions=10), task)
    assert model.max_positions() == 10


def test_flops_per_token():
    model = tiny_model(share_decoder_input_output_embed=True)
    body = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embed_"))
    assert model.num_matmul_parameters() == body + VOCAB * 32
    assert model.flops_per_token(16) == 6 * (body + VOCAB * 32) + 12 * 2 * 32 * 16
    cfg = model_config("transformer_lm_gpt3_small")
    meta = build_on_meta("transformer_lm_gpt3_small", vocab_size=50257, tokens_per_sample=2048)
    assert meta.flops_per_token(2048) == flops_per_token(cfg, 2048, meta.num_matmul_parameters())
    assert 6 * 123e6 < meta.flops_per_token(2048) < 6 * 125e6 + 12 * 12 * 768 * 2048


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_init_weights_deterministic_per_seed():
    a, b, c = tiny_model(seed=3), tiny_model(seed=3), tiny_model(seed=4)
    sa, sb, sc = _state(a), _state(b), _state(c)
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], rtol=0, atol=0)
    assert not torch.equal(sa["layers.0.fc1.weight"], sc["layers.0.fc1.weight"])
    assert not torch.equal(sa["embed_tokens.weight"], sc["embed_tokens.weight"])
    # re-initializing in place gives the same values back
    for p in a.parameters():
        p.data.zero_()
    init_weights(a, 3)
    for name, value in _state(a).items():
        torch.testing.assert_close(value, sa[name], rtol=0, atol=0)
    # the default seed follows torch.manual_seed, independent of RNG calls made in between
    torch.manual_seed(3)
    torch.rand(10)
    d = TransformerLanguageModel(tiny_cfg(), VOCAB, PAD)
    torch.testing.assert_close(d.layers[1].fc2.weight, b.layers[1].fc2.weight, rtol=0, atol=0)


def test_init_weights_values_do_not_depend_on_the_thread_count():
    """init_weights draws parameters on a thread pool: any pool size gives a serial build's values."""
    serial = tiny_model(seed=0)
    init_weights(serial, 9, threads=1)
    for threads in (2, 5):
        pooled = tiny_model(seed=1)
        init_weights(pooled, 9, threads=threads)
        for name, value in serial.state_dict().items():
            torch.testing.assert_close(pooled.state_dict()[name], value, rtol=0, atol=0)
    assert all(not p.grad_fn for p in pooled.parameters())


def test_init_weights_raises_a_parameters_error_from_the_pool():
    model = tiny_model(seed=0)
    owner_rule = model.initial_value

    def broken(name, shape, generator):
        if name == "layers.1.fc2.weight":
            raise KeyError(f"no initialization rule for parameter {name}")
        return owner_rule(name, shape, generator)

    model.initial_value = broken
    with pytest.raises(KeyError, match="layers.1.fc2.weight"):
        init_weights(model, 3, threads=4)


def test_init_values_depend_only_on_parameter_name():
    two, three = tiny_model(seed=1, decoder_layers=2), tiny_model(seed=1, decoder_layers=3)
    for name, value in two.state_dict().items():
        torch.testing.assert_close(value, three.state_dict()[name], rtol=0, atol=0)
    assert not torch.equal(two.layers[0].fc1.weight, two.layers[1].fc1.weight)


def test_init_rules():
    model = tiny_model(seed=0)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            assert torch.count_nonzero(p) == 0, name
        elif "layer_norm" in name:
            assert torch.all(p == 1), name
    w = model.layers[0].fc1.weight
    assert w.abs().max() <= math.sqrt(6 / (32 + 64))
    assert model.embed_tokens.weight.std().item() == pytest.approx(32**-0.5, rel=0.15)


@pytest.mark.parametrize("kind", sorted(POSITION_KINDS))
def test_meta_build_then_init_equals_direct_build(kind):
    direct = tiny_model(seed=11, **POSITION_KINDS[kind]).eval()
    with torch.device("meta"):
        deferred = TransformerLanguageModel(tiny_cfg(**POSITION_KINDS[kind]), VOCAB, PAD)
    assert all(p.is_meta for p in deferred.parameters())
    with pytest.raises(RuntimeError, match="meta"):
        init_weights(deferred, 11)
    deferred.to_empty(device="cpu")
    init_weights(deferred, 11)
    deferred.eval()
    for name, value in direct.state_dict().items():
        torch.testing.assert_close(deferred.state_dict()[name], value, rtol=0, atol=0)
    for (name, buf), (_, ref) in zip(deferred.named_buffers(), direct.named_buffers()):
        torch.testing.assert_close(buf, ref, rtol=0, atol=0)
    x = tokens()
    torch.testing.assert_close(deferred(x), direct(x), rtol=0, atol=0)


def test_init_through_wrappers_uses_the_plain_names():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    direct = tiny_model(seed=5)
    wrapped = tiny_model(seed=0)
    for i, layer in enumerate(wrapped.layers):
        wrapped.layers[i] = checkpoint_wrapper(layer)
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_parameters())
    init_weights(wrapped, 5)
    for name, p in wrapped.named_parameters():
        torch.testing.assert_close(p, direct.get_parameter(canonical_name(name)), rtol=0, atol=0)
    assert canonical_name("module._orig_mod.layers.0._checkpoint_wrapped_module.fc1.weight") == "layers.0.fc1.weight"


def test_architecture_values_derived_from_a_given_option_follow_it():
    # fairseq's base_gpt3_architecture: FFN = 4 x the (user's) embedding dimension unless given
    from toolkit.config import TRAIN_CONFIGS

    def parse(*extra):
        return options.parse_with_components(
            "toolkit-train", TRAIN_CONFIGS, ["data", "--arch", "transformer_lm_gpt3_xl", *extra]
        )

    assert (parse().decoder_embed_dim, parse().decoder_ffn_embed_dim) == (2048, 8192)
    args = parse("--decoder-embed-dim", "1024")
    assert (args.decoder_embed_dim, args.decoder_ffn_embed_dim, args.decoder_layers) == (1024, 4096, 24)
    args = parse("--decoder-embed-dim=1024", "--decoder-ffn-embed-dim", "100")
    assert (args.decoder_embed_dim, args.decoder_ffn_embed_dim) == (1024, 100)
    assert (
        options.architecture_defaults("transformer_lm_gpt3_xl", {"decoder_embed_dim": 512})["decoder_ffn_embed_dim"]
        == 2048
    )
