"""toolkit.models.common's shared modules (norms, rotary embeddings, MLPs), each option against a direct
computation (the attention's: test_attention.py)."""

import math

import pytest
import torch
import torch.nn.functional as F

from toolkit.models.common.mlp import FEED_FORWARDS
from toolkit.models.common.norms import RMSNorm
from toolkit.models.common.rope import RopeScaling, apply_rope, rope_frequencies, rope_tables


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


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
