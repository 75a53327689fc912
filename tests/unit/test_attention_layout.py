"""Attention's q/k/v layout (split of the fused projection) against the fused view/permute/unbind formula.

The reference is the formula the model used before: ``qkv.view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
.unbind(0)``, computed here on the same weights. Output and every gradient must agree to fp32
rounding, with and without a KV cache, so checkpoints and decoding are unchanged.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from toolkit.models.transformer_lm import CausalSelfAttention, KVCache, TransformerLMConfig


def reference_attention(attn: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    """The fused-QKV formula: rows [q | k | v] of qkv_proj, viewed as [3, B, H, T, D]."""
    B, T, C = x.shape
    q, k, v = attn.qkv_proj(x).view(B, T, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attn.out_proj(y.transpose(1, 2).flatten(2))


def make_attention(C: int = 48, H: int = 4, seed: int = 0) -> CausalSelfAttention:
    torch.manual_seed(seed)
    attn = CausalSelfAttention(TransformerLMConfig(decoder_embed_dim=C, decoder_attention_heads=H))
    attn = attn.to_empty(device="cpu")
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.2)
    return attn


@pytest.mark.parametrize("C,H,T", [(48, 4, 13), (64, 1, 8), (32, 8, 1)])
def test_split_layout_matches_fused_formula(C, H, T):
    new = make_attention(C, H)
    old = copy.deepcopy(new)
    x = torch.randn(3, T, C, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = new(x), reference_attention(old, x_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    for (name, p), p_ref in zip(new.named_parameters(), old.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_split_layout_with_kv_cache_matches_full_prefix():
    """Decoding one token at a time through the cache gives the full-sequence reference outputs."""
    attn = make_attention(48, 4).eval()
    x = torch.randn(2, 9, 48)
    with torch.no_grad():
        expected = reference_attention(attn, x)
        cache = KVCache()
        first = attn(x[:, :4], cache)
        steps = [attn(x[:, t : t + 1], cache) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), expected, rtol=1e-5, atol=1e-6)


def test_split_layout_backward_has_no_strided_copy():
    """split's backward concatenates the three gradients once; nothing else copies q/k/v gradients."""
    from torch.profiler import ProfilerActivity, profile

    attn = make_attention(48, 4)
    x = torch.randn(2, 16, 48, requires_grad=True)
    y = attn(x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y.backward(torch.randn_like(y))
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("aten::cat", 0) == 1, calls  # split's backward
    for kernel in ("aten::stack", "aten::copy_", "aten::clone"):  # the fused formula's stack + strided copy
        assert calls.get(kernel, 0) == 0, (kernel, calls)
