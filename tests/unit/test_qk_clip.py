"""Kimi K2's QK-clip (``toolkit.models.common.attention.qk_clip``): a head whose largest logit went past tau has a
largest logit of exactly tau on the same input after the rescale, every other head's logits (and, where no key
head is shared, weights) untouched; multi-head, grouped-query, fairseq's fused and latent attention."""

from __future__ import annotations

import pytest
import torch

from toolkit.core.errors import UserError
from toolkit.models.common.attention import Attention, FusedQKVAttention, LatentAttention
from toolkit.models.common.attention.qk_clip import clip_heads, qk_clip_hook
from toolkit.models.common.rope import rope_frequencies

T, C = 12, 32


def _layer(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mha":
        layer = Attention(C, 4, 4, 8, qkv_bias=True)
    elif kind == "gqa":
        layer = Attention(C, 4, 2, 8, qkv_bias=True)
    elif kind == "fused":
        layer = FusedQKVAttention(C, 4)
    else:
        layer = LatentAttention(C, 4, kv_rank=12, rope_dim=4, nope_dim=8, v_dim=6, q_rank=10)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    return layer.train()


def _max_logits(layer, x, kind: str) -> torch.Tensor:
    """The heads' largest logits of one training forward on ``x`` (the layer records them)."""
    dim = 4 if kind == "latent" else 8
    inv_freq, _ = rope_frequencies(dim, 10000.0)
    angles = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq).repeat(1, 2)
    cos, sin = (None, None) if kind == "fused" else (angles.cos(), angles.sin())
    layer.max_logit = None
    layer(x) if kind == "fused" else layer(x, cos, sin)
    return layer.max_logit.clone()


@pytest.mark.parametrize("kind", ["mha", "gqa", "fused", "latent"])
def test_a_head_past_tau_ends_at_tau_and_the_others_are_untouched(kind):
    layer = _layer(kind)
    x = torch.randn(2, T, C, generator=torch.Generator().manual_seed(1))
    layers = [layer]
    qk_clip_hook(layer, 1.0)  # sets recording on
    before = _max_logits(layer, x, kind)
    tau = float(before.sort().values[-2] + before.max()) / 2  # only the largest head is past it
    hot = int(before.argmax())
    weights = {n: p.detach().clone() for n, p in layer.named_parameters()}
    assert clip_heads(layers, tau) == 1 and layer.max_logit is None
    after = _max_logits(layer, x, kind)
    assert after[hot].item() == pytest.approx(tau, rel=1e-5)
    others = torch.arange(len(before)) != hot
    torch.testing.assert_close(after[others], before[others], rtol=1e-5, atol=1e-6)
    if kind in ("mha", "fused"):  # no key head shared: only the hot head's query and key rows moved
        head = set(range(hot * 8, hot * 8 + 8))
        allowed = {"q_proj": head, "k_proj": head, "qkv_proj": head | {C + r for r in head}}
        for name, p in layer.named_parameters():
            changed = (p.detach() != weights[name]).reshape(p.size(0), -1).any(dim=1).nonzero().flatten().tolist()
            assert set(changed) == allowed.get(name.split(".")[0], set()), name
    if kind == "latent":  # the compressions (the shared rotary key among them) are untouched
        for name in ("kv_a_proj_with_mqa.weight", "q_a_proj.weight", "o_proj.weight"):
            assert torch.equal(dict(layer.named_parameters())[name], weights[name])


def test_refuses_qk_norm():
    layer = Attention(C, 4, 4, 8, qk_norm_eps=1e-6)
    with pytest.raises(UserError, match="--qk-clip-threshold with --qk-norm"):
        qk_clip_hook(layer, 10.0)
