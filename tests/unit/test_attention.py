"""toolkit.models.common.attention: each back end against a direct computation, the back-end choice, each variant's
options (against Hugging Face's eager attention where transformers has the model), and each variant's cached
decoding (in place and as tensors in and out, ONNX's form) equal to its full forward."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.models.common.rope import apply_rope, rope_frequencies, rope_tables
from toolkit.models.common.attention import (
    EVERY_KEY,
    Attention,
    AttentionLayer,
    ChunkedVisibility,
    FusedQKVAttention,
    GatedAttention,
    KVCache,
    LatentAttention,
    attend,
    attention_mask,
    causal_mask,
    choose_backend,
    explicit_attention,
)
from toolkit.models.common.attention.backends import EXPLICIT, FLEX, SDPA, TILES, flex
from toolkit.models.common.attention.masks import block_mask


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def reference_attention(q, k, v, visible, scale=None, softcap=None, sinks=None):
    """Loops over query positions: softmax over the visible keys only (and the head's sink), heads repeated for GQA."""
    B, H, T, D = q.shape
    k, v = k.repeat_interleave(H // k.size(1), 1), v.repeat_interleave(H // v.size(1), 1)
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = torch.zeros(B, H, T, v.size(-1), dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            keys = [s for s in range(k.size(2)) if visible(b, t, s)]
            s = torch.einsum("hd,hkd->hk", q[b, :, t].double(), k[b, :, keys].double()) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            if sinks is None:
                p = torch.softmax(s, -1)
            else:
                p = torch.softmax(torch.cat([s, sinks.double()[:, None]], -1), -1)[:, :-1]
            out[b, :, t] = torch.einsum("hk,hkd->hd", p, v[b, :, keys].double())
    return out


def qkv(B=2, H=4, G=2, T=9, D=8, seed=0):
    g = gen(seed)
    return (
        torch.randn(B, H, T, D, generator=g),
        torch.randn(B, G, T, D, generator=g),
        torch.randn(B, G, T, D, generator=g),
    )


CAUSAL = lambda b, t, s: s <= t  # noqa: E731


# ---- the back ends ----


def test_grouped_query_attention_equals_repeated_heads():
    q, k, v = qkv(H=6, G=2)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True)
    assert torch.allclose(attend(q, k, v), want, atol=1e-6)
    q1, k1, v1 = qkv(H=4, G=1)  # multi-query
    assert torch.allclose(attend(q1, k1, v1), reference_attention(q1, k1, v1, CAUSAL).float(), atol=1e-5)


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
    want = reference_attention(q, k, v, CAUSAL, softcap=5.0)
    got = attend(q, k, v, softcap=5.0)
    assert torch.allclose(got, want.float(), atol=1e-5)
    assert not torch.allclose(attend(q, k, v), got, atol=1e-3)
    window = attention_mask(None, 9, window=2)
    want = reference_attention(q, k, v, lambda b, t, s: t - 2 < s <= t, scale=0.1, softcap=5.0)
    assert torch.allclose(attend(q, k, v, window, scale=0.1, softcap=5.0), want.float(), atol=1e-5)


def test_explicit_attention_is_sdpa_without_a_cap():
    q, k, v = qkv()
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert torch.allclose(explicit_attention(q, k, v, causal_mask(0, 9)), want, atol=1e-6)
    assert torch.allclose(explicit_attention(q, k, v), want, atol=1e-6)  # None: causal
    assert torch.allclose(attend(q, k, v, export=True), want, atol=1e-6)  # export traces the explicit form


def test_queries_after_the_cache_see_the_keys_up_to_themselves():
    """Fewer queries than keys: causal aligns them with the last keys (SDPA's is_causal would take the first)."""
    q, k, v = qkv(T=9)
    q = q[:, :, 6:]
    want = reference_attention(q, k, v, lambda b, t, s: s <= t + 6).float()
    assert torch.allclose(attend(q, k, v), want, atol=1e-5)
    assert torch.allclose(attend(q, k, v, causal_mask(6, 3)), want, atol=1e-5)
    assert torch.allclose(attend(q[:, :, -1:], k, v, EVERY_KEY), want[:, :, -1:], atol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_sinks_take_their_share_of_each_row_as_transformers_gpt_oss_does(window):
    """gpt-oss's sinks: a learned logit per head in each row's softmax, no value behind it; equal to the formula
    and to transformers' own eager attention (``modeling_gpt_oss.eager_attention_forward``) under its additive mask."""
    q, k, v = qkv(H=4, G=2, T=9)
    sinks = torch.randn(4, generator=gen(5)) * 2
    visible = causal_mask(0, 9, window)
    want = reference_attention(q, k, v, lambda b, t, s: bool(visible[t, s]), sinks=sinks)
    mask = None if window is None else visible
    got = attend(q, k, v, mask, sinks=sinks)
    assert torch.allclose(got, want.float(), atol=1e-5)
    assert not torch.allclose(got, attend(q, k, v, mask), atol=1e-3)  # the sinks take part of the weight
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    stub = nn.Module()
    stub.sinks, stub.num_key_value_groups = nn.Parameter(sinks.clone()), 2
    additive = torch.zeros(9, 9).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None]
    theirs, _ = gpt_oss.eager_attention_forward(stub, q, k, v, additive, scaling=8**-0.5)
    torch.testing.assert_close(got.transpose(1, 2), theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_backend_caps_and_sinks_as_the_explicit_form():
    """flex_attention under a block mask of documents and a window: the soft-cap as its score_mod, the sinks through
    its log-sum-exp, equal to the explicit form (eager flex_attention: its forward runs on CPU)."""
    flex_module = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = qkv(B=2, H=4, G=2, T=16, D=16)
    q = q * 3
    ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 12 + [1] * 4])
    block = block_mask(ids, 16, 4, "cpu")
    dense = attention_mask(ids, 16, window=4)
    sinks = torch.randn(4, generator=gen(2))
    for options in ({}, {"softcap": 2.0}, {"sinks": sinks}, {"softcap": 2.0, "sinks": sinks, "scale": 0.3}):
        got = flex(q, k, v, block, kernel=flex_module.flex_attention, **options)
        torch.testing.assert_close(got, explicit_attention(q, k, v, dense, **options), rtol=1e-5, atol=1e-5)


def test_choose_backend_picks_by_what_the_call_needs():
    q = torch.zeros(1, 2, 8, 16)
    narrow = torch.zeros(1, 2, 8, 8)
    ids = torch.zeros(1, 8, dtype=torch.long)
    block = block_mask(ids, 8, None, "cpu") if _has_flex() else None
    shard = ChunkedVisibility(torch.arange(8), torch.arange(8))
    narrow_values = {"v": torch.zeros(1, 2, 8, 12)}
    cases = [
        (None, q, {}, SDPA),
        (causal_mask(0, 8), q, {}, SDPA),
        (None, q, {"softcap": 1.0}, EXPLICIT),
        (None, q, {"sinks": torch.zeros(2)}, EXPLICIT),
        (None, q, {"export": True}, EXPLICIT),
        (shard, q, {}, TILES),
        (shard, q, {"softcap": 1.0}, EXPLICIT),
        (shard, q, {"sinks": torch.zeros(2)}, EXPLICIT),
        (shard, q, {"export": True}, EXPLICIT),
        (shard, torch.zeros(1, 2, 8, 20), narrow_values, SDPA),  # the CPU flash kernel wants one head size
    ]
    if block is not None:
        cases += [
            (block, q, {}, FLEX),
            (block, q, {"softcap": 1.0, "sinks": torch.zeros(2)}, FLEX),
            (block, narrow, {}, SDPA),  # heads narrower than flex's kernel takes: the dense mask
            (block, narrow, {"softcap": 1.0}, EXPLICIT),
            (block, q, {"dropout": 0.1}, SDPA),
        ]
    for mask, query, options, backend in cases:
        assert choose_backend(mask, query, **options) == backend, (mask, options)


def _has_flex():
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


# ---- the variants ----


def init(module, seed=0, std=0.3):
    torch.manual_seed(seed)
    module = module.to_empty(device="cpu") if any(p.is_meta for p in module.parameters()) else module
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, std)
    return module


def make_attention(seed=0, cls=Attention, kv_heads=2, **kw):
    return init(cls(32, 4, kv_heads, 8, **kw), seed)


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
    want = attn.o_proj(reference_attention(q, k, v, CAUSAL).float().transpose(1, 2).flatten(2))
    assert torch.allclose(attn(x, cos, sin), want, atol=1e-5)
    assert {"q_norm.weight", "k_norm.weight"} <= set(attn.state_dict())
    assert "q_norm.weight" not in make_attention().state_dict()


def test_qk_norm_over_the_projection_normalizes_all_heads_together():
    """OLMo 2 / OLMoE: one RMSNorm over the whole q [H*D] and k [G*D] projections, before the heads split."""
    attn = make_attention(qk_norm_eps=1e-6, qk_norm_per_head=False)
    assert attn.q_norm.weight.shape == (32,) and attn.k_norm.weight.shape == (16,)
    x = torch.randn(2, 7, 32, generator=gen())
    cos, sin = rope_tables(rope_frequencies(8, 10000.0)[0], 7)

    def whole(y, w, heads):
        y = y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        return y.view(2, 7, heads, 8).transpose(1, 2)

    q = apply_rope(whole(attn.q_proj(x), attn.q_norm.weight, 4), cos, sin)
    k = apply_rope(whole(attn.k_proj(x), attn.k_norm.weight, 2), cos, sin)
    v = attn.v_proj(x).view(2, 7, 2, 8).transpose(1, 2)
    want = attn.o_proj(reference_attention(q, k, v, CAUSAL).float().transpose(1, 2).flatten(2))
    assert torch.allclose(attn(x, cos, sin), want, atol=1e-5)


def test_gated_attention_matches_transformers_qwen3_next():
    """Qwen3-Next's attention (per-head [q | gate] in q_proj, (1 + w) QK-norm, o_proj(attention * sigmoid(gate))):
    the same output as transformers' ``Qwen3NextAttention`` (eager) on the same weights."""
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        partial_rotary_factor=1.0,
        rms_norm_eps=1e-6,
        num_hidden_layers=1,
        layer_types=["full_attention"],
    )
    config._attn_implementation = "eager"
    theirs = init(modeling.Qwen3NextAttention(config, 0), seed=1).eval()
    ours = GatedAttention(32, 4, 2, 8, qk_norm_eps=1e-6, qk_norm_unit_offset=True)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 7, 32, generator=gen(4))
    cos, sin = rope_tables(rope_frequencies(8, 10000.0)[0], 7)
    additive = torch.zeros(7, 7).masked_fill(~causal_mask(0, 7), torch.finfo(torch.float32).min)[None, None]
    want, _ = theirs(x, (cos[None], sin[None]), additive)
    torch.testing.assert_close(ours(x, cos, sin), want, rtol=1e-5, atol=1e-6)
    plain = Attention(32, 4, 2, 8, qk_norm_eps=1e-6, qk_norm_unit_offset=True)
    assert ours.q_proj.weight.shape == (2 * plain.q_proj.weight.shape[0], 32)


VARIANTS = {
    "mha": lambda: make_attention(kv_heads=4),
    "gqa": lambda: make_attention(),
    "mqa": lambda: make_attention(kv_heads=1),
    "window": lambda: make_attention(window=3),
    "softcap_window_qk_norm": lambda: make_attention(softcap=2.0, window=4, qk_norm_eps=1e-5),
    "qk_norm_projection_scale": lambda: make_attention(qk_norm_eps=1e-5, qk_norm_per_head=False, scale=0.2),
    "sinks_window_biases": lambda: make_attention(sinks=True, window=5, qkv_bias=True, output_bias=True),
    "gated": lambda: make_attention(cls=GatedAttention, qk_norm_eps=1e-6, qk_norm_unit_offset=True),
    "latent": lambda: init(LatentAttention(32, 4, kv_rank=6, rope_dim=4, nope_dim=8, v_dim=6, q_rank=12)),
    "latent_without_q_rank": lambda: init(LatentAttention(32, 4, kv_rank=6, rope_dim=8, nope_dim=8, v_dim=16)),
    "fused_qkv": lambda: init(FusedQKVAttention(32, 4)),
}


def run(attn, x, cos, sin, **kw):
    if isinstance(attn, FusedQKVAttention):
        return attn(x, **kw)
    return attn(x, cos, sin, **kw)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cached_decoding_equals_the_full_forward(name):
    """A prompt of 6 then one token at a time through the in-place cache, and the same as tensors in and out
    (``forward_with_past``, ONNX's form): the full forward's outputs; the cache holds the variant's entries."""
    attn = VARIANTS[name]().eval()
    x = torch.randn(2, 11, 32, generator=gen(3))
    cos, sin = rope_tables(rope_frequencies(getattr(attn, "rope_dim", 8), 10000.0)[0], 11)
    with torch.no_grad():
        full = run(attn, x, cos, sin)
        cache = KVCache()
        pieces = [run(attn, x[:, :6], cos[:6], sin[:6], kv_cache=cache)]
        pieces += [run(attn, x[:, t : t + 1], cos[t : t + 1], sin[t : t + 1], kv_cache=cache) for t in range(6, 11)]
        torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-5)
        _, entries, _ = attn.project(x[:, :1], cos[:1], sin[:1])
        assert [e.shape[:2] + e.shape[3:] for e in cache.buffers] == [e.shape[:2] + e.shape[3:] for e in entries]
        window = getattr(attn, "window", None)
        assert cache.length == (11 if window is None else window - 1)
        past = tuple(e[:, :, :0] for e in entries)
        first, past = attn.forward_with_past(x[:, :6], cos[:6], sin[:6], past)
        second, past = attn.forward_with_past(x[:, 6:], cos[6:], sin[6:], past)
        torch.testing.assert_close(torch.cat([first, second], 1), full, rtol=1e-5, atol=1e-5)
        assert past[0].size(2) == 11


def test_latent_attention_pads_narrower_values_for_the_fused_kernel_to_the_same_values_and_gradients(monkeypatch):
    """On the CPU, values narrower than the queries (Dv 6 < Dn + Dr 12) reach SDPA padded to the queries' width (its
    fused kernel's rule): the outputs and gradients of the unpadded call."""
    attn = VARIANTS["latent"]()
    x = torch.randn(2, 9, 32, generator=gen(4))
    cos, sin = rope_tables(rope_frequencies(4, 10000.0)[0], 9)
    widths, core = [], AttentionLayer.attend

    def recorded(layer, q, k, v, mask, export=False):
        widths.append(v.size(-1))
        return core(layer, q, k, v, mask, export)

    monkeypatch.setattr(AttentionLayer, "attend", recorded)
    results = []
    for unpadded in (False, True):
        if unpadded:
            monkeypatch.setattr(LatentAttention, "attend", recorded)
        attn.zero_grad()
        x_in = x.clone().requires_grad_()
        y = attn(x_in, cos, sin)
        y.square().sum().backward()
        results.append((y.detach(), x_in.grad, *[p.grad for p in attn.parameters()]))
    assert widths == [12, 6]
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)


def test_kv_cache_reorders_and_forgets_every_entry():
    cache = KVCache()
    a, b = torch.arange(2 * 3 * 4.0).view(2, 1, 3, 4), torch.arange(2 * 3 * 2.0).view(2, 1, 3, 2)
    cache.append(a, b)
    cache.reorder(torch.tensor([1, 1, 0]))
    kept_a, kept_b = cache.append(a[[1, 1, 0], :, :1], b[[1, 1, 0], :, :1])
    assert torch.equal(kept_a[:, :, :3], a[[1, 1, 0]]) and torch.equal(kept_b[:, :, 3], b[[1, 1, 0], :, 0])
    cache.keep_last(2)
    assert cache.length == 2 and torch.equal(cache.buffers[1][:, :, :2], kept_b[:, :, 2:])


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
