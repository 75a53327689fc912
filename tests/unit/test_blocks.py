"""toolkit.models.blocks: each option of the shared modules against a direct computation."""

import math

import pytest
import torch
import torch.nn.functional as F

from toolkit.models.blocks.attention import Attention, attend, attention_mask, causal_mask, explicit_attention
from toolkit.models.blocks.feed_forward import FEED_FORWARDS
from toolkit.models.blocks.norms import RMSNorm
from toolkit.models.blocks.rope import RopeScaling, apply_rope, rope_frequencies, rope_tables
from toolkit.models.decoder import KVCache


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def reference_attention(q, k, v, visible, scale=None, softcap=None):
    """Loops over query positions: softmax over the visible keys only, heads repeated for GQA."""
    B, H, T, D = q.shape
    k, v = k.repeat_interleave(H // k.size(1), 1), v.repeat_interleave(H // v.size(1), 1)
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = torch.zeros_like(q, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            keys = [s for s in range(k.size(2)) if visible(b, t, s)]
            s = torch.einsum("hd,hkd->hk", q[b, :, t].double(), k[b, :, keys].double()) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            out[b, :, t] = torch.einsum("hk,hkd->hd", torch.softmax(s, -1), v[b, :, keys].double())
    return out


def qkv(B=2, H=4, G=2, T=9, D=8, seed=0):
    g = gen(seed)
    return (
        torch.randn(B, H, T, D, generator=g),
        torch.randn(B, G, T, D, generator=g),
        torch.randn(B, G, T, D, generator=g),
    )


def test_rmsnorm_and_its_unit_offset_variant_match_the_formula():
    x = torch.randn(3, 5, 16, generator=gen())
    w = torch.randn(16, generator=gen(1))
    rms = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    plain, offset = RMSNorm(16, 1e-6), RMSNorm(16, 1e-6, unit_offset=True)
    with torch.no_grad():
        plain.weight.copy_(w)
        offset.weight.copy_(w)
    assert torch.allclose(plain(x), x / rms * w, atol=1e-6)
    assert torch.allclose(offset(x), x / rms * (1 + w), atol=1e-6)
    with torch.no_grad():
        offset.weight.zero_()  # Gemma's initial value: the identity scale
    assert torch.allclose(offset(x), x / rms, atol=1e-6)
    assert offset(x.bfloat16()).dtype == torch.bfloat16


def test_rotary_tables_and_rotation_match_the_complex_formula():
    D, T, theta = 8, 6, 10000.0
    inv_freq, factor = rope_frequencies(D, theta)
    assert factor == 1.0
    cos, sin = rope_tables(inv_freq, T)
    x = torch.randn(1, 2, T, D, generator=gen())
    # each pair (x_i, x_{i+D/2}) is a complex number rotated by position * theta^(-2i/D)
    z = torch.complex(x[..., : D // 2].double(), x[..., D // 2 :].double())
    angle = torch.arange(T).double()[:, None] * theta ** (-torch.arange(0, D, 2).double() / D)
    rotated = z * torch.polar(torch.ones_like(angle), angle)
    assert torch.allclose(apply_rope(x, cos, sin).double(), torch.cat([rotated.real, rotated.imag], -1), atol=1e-5)


def test_llama3_scaling_divides_low_frequencies_keeps_high_ones():
    D, theta = 64, 500000.0
    plain, _ = rope_frequencies(D, theta)
    scaled, factor = rope_frequencies(D, theta, RopeScaling(factor=8.0, original_max_positions=8192))
    wavelen = 2 * math.pi / plain
    assert factor == 1.0
    assert torch.equal(scaled[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])
    assert torch.allclose(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)
    between = (wavelen > 8192 / 4) & (wavelen < 8192)
    assert between.any() and ((scaled[between] < plain[between]) & (scaled[between] > plain[between] / 8)).all()


def test_grouped_query_attention_equals_repeated_heads():
    q, k, v = qkv(H=6, G=2)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True)
    assert torch.allclose(attend(q, k, v), want, atol=1e-6)
    q1, k1, v1 = qkv(H=4, G=1)  # multi-query
    assert torch.allclose(
        attend(q1, k1, v1), reference_attention(q1, k1, v1, lambda b, t, s: s <= t).float(), atol=1e-5
    )


@pytest.mark.parametrize("window", [1, 3, 20])
def test_sliding_window_equals_an_explicit_mask(window):
    q, k, v = qkv()
    mask = attention_mask(None, q.size(2), window=window)
    want = reference_attention(q, k, v, lambda b, t, s: t - window < s <= t)
    assert torch.allclose(attend(q, k, v, mask), want.float(), atol=1e-5)
    assert torch.equal(causal_mask(0, 9, window), mask[0, 0])


def test_sliding_window_inside_documents():
    q, k, v = qkv(T=10)
    ids = torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3])
    mask = attention_mask(ids, 10, window=3)
    want = reference_attention(q, k, v, lambda b, t, s: t - 3 < s <= t and ids[b, s] == ids[b, t])
    assert torch.allclose(attend(q, k, v, mask), want.float(), atol=1e-5)


def test_logit_softcapping_matches_the_formula():
    q, k, v = qkv()
    q = q * 10  # logits large enough for the cap to matter
    want = reference_attention(q, k, v, lambda b, t, s: s <= t, softcap=5.0)
    got = attend(q, k, v, softcap=5.0)
    assert torch.allclose(got, want.float(), atol=1e-5)
    assert not torch.allclose(attend(q, k, v), got, atol=1e-3)
    window = attention_mask(None, 9, window=2)
    want = reference_attention(q, k, v, lambda b, t, s: t - 2 < s <= t, scale=0.1, softcap=5.0)
    assert torch.allclose(attend(q, k, v, window, scale=0.1, softcap=5.0), want.float(), atol=1e-5)


def test_explicit_attention_is_sdpa_without_a_cap():
    q, k, v = qkv()
    mask = causal_mask(0, 9)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert torch.allclose(explicit_attention(q, k, v, mask), want, atol=1e-6)


def make_attention(seed=0, **kw):
    torch.manual_seed(seed)
    attn = Attention(32, 4, 2, 8, **kw)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return attn


def test_qk_norm_normalizes_each_head_of_q_and_k_before_the_rotation():
    attn = make_attention(qk_norm_eps=1e-6)
    x = torch.randn(2, 7, 32, generator=gen())
    cos, sin = rope_tables(rope_frequencies(8, 10000.0)[0], 7)

    def per_head(y, w):
        y = y.view(2, 7, -1, 8)
        return (y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * w).transpose(1, 2)

    q = apply_rope(per_head(attn.q_proj(x), attn.q_norm.weight), cos, sin)
    k = apply_rope(per_head(attn.k_proj(x), attn.k_norm.weight), cos, sin)
    v = attn.v_proj(x).view(2, 7, 2, 8).transpose(1, 2)
    want = attn.o_proj(reference_attention(q, k, v, lambda b, t, s: s <= t).float().transpose(1, 2).flatten(2))
    assert torch.allclose(attn(x, cos, sin), want, atol=1e-5)
    assert {"q_norm.weight", "k_norm.weight"} <= set(attn.state_dict())
    assert "q_norm.weight" not in make_attention().state_dict()


@pytest.mark.parametrize("options", [{}, {"window": 3}, {"softcap": 2.0, "window": 4, "qk_norm_eps": 1e-5}])
def test_kv_cache_decoding_equals_the_full_forward(options):
    attn = make_attention(**options)
    x = torch.randn(2, 11, 32, generator=gen(3))
    cos, sin = rope_tables(rope_frequencies(8, 10000.0)[0], 11)
    full = attn(x, cos, sin)
    cache = KVCache()
    pieces = [attn(x[:, :6], cos[:6], sin[:6], cache)]
    pieces += [attn(x[:, t : t + 1], cos[t : t + 1], sin[t : t + 1], cache) for t in range(6, 11)]
    assert torch.allclose(torch.cat(pieces, 1), full, atol=1e-5)


@pytest.mark.parametrize(
    "kind,formula",
    [
        ("swiglu", lambda m, x: m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))),
        ("geglu", lambda m, x: m.down_proj(F.gelu(m.gate_proj(x), approximate="tanh") * m.up_proj(x))),
        ("gelu", lambda m, x: m.down_proj(F.gelu(m.up_proj(x)))),
    ],
)
def test_feed_forwards_match_their_formulas(kind, formula):
    torch.manual_seed(0)
    m = FEED_FORWARDS[kind](16, 40)
    x = torch.randn(2, 3, 16, generator=gen())
    assert torch.allclose(m(x), formula(m, x), atol=1e-6)
    x0 = x[..., :1].expand_as(x)
    if kind == "gelu":  # x * Phi(x), not 0.5 x (1 + tanh(...))
        assert torch.allclose(m.act(x0), x0 * 0.5 * (1 + torch.erf(x0 / math.sqrt(2))), atol=1e-6)


def test_llama_cached_decoder_runs_the_attention_options():
    """The ONNX ``--kv-cache`` forward reads the layers' window and soft-cap: same logits as the model."""
    from toolkit.models.llama.config import LlamaConfig
    from toolkit.models.llama.model import LlamaLanguageModel

    model = LlamaLanguageModel(LlamaConfig(max_target_positions=32, decoder_kv_heads=2), 40, 1, seed=1)
    for layer in model.layers:
        layer.self_attn.window, layer.self_attn.softcap = 4, 1.5
    tokens = torch.randint(2, 40, (2, 12), generator=gen())
    decoder = model.onnx_cached_decoder()
    G, D = decoder.cache_shape
    first = decoder(tokens[:, :7], *[torch.zeros(2, G, 0, D)] * (2 * len(model.layers)))
    second = decoder(tokens[:, 7:], *first[1:])
    assert torch.allclose(torch.cat([first[0], second[0]], 1), model(tokens), atol=1e-5)
