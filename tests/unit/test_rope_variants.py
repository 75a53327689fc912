"""Rotary variants of toolkit/models/common/rope.py against transformers' arithmetic: partial rotary (GPT-NeoX's
``rotary_pct``, Phi's and Qwen3-Next's ``partial_rotary_factor``: int(head size x factor) features rotated with
frequencies over that width, the rest passed through) and linear scaling; a model with partial rotary keeps
its KV cache exact and leaves the unrotated features free of position; impossible factors are one line."""

from __future__ import annotations

import pytest
import torch

from toolkit.core import registry
from toolkit.core.errors import UserError
from toolkit.models import model_config
from toolkit.models.common.options import rotary_dim
from toolkit.models.common.rope import apply_rope, decoder_tables, rope_frequencies

transformers = pytest.importorskip("transformers")
from transformers.models.gpt_neox import modeling_gpt_neox  # noqa: E402


def neox(head_size: int, factor: float, theta: float = 10000.0):
    """GPT-NeoX's rotary embedding module and config (its partial_rotary_factor, transformers 5's rope_parameters)."""
    config = transformers.GPTNeoXConfig(
        hidden_size=head_size * 2,
        num_attention_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor},
    )
    return modeling_gpt_neox.GPTNeoXRotaryEmbedding(config), config


@pytest.mark.parametrize("head_size,factor", [(64, 0.25), (80, 0.25), (64, 0.5), (32, 1.0), (128, 0.375)])
def test_partial_rotary_tables_equal_gpt_neox(head_size, factor):
    rotary, config = neox(head_size, factor)
    cfg = model_config(
        "llama_tiny", decoder_embed_dim=head_size * 2, decoder_attention_heads=2, partial_rotary_factor=factor
    )
    assert rotary_dim(cfg) == int(head_size * factor) == rotary.inv_freq.numel() * 2
    ours, _ = rope_frequencies(rotary_dim(cfg), cfg.rope_theta)
    torch.testing.assert_close(ours, rotary.inv_freq, rtol=1e-6, atol=0)
    positions = torch.arange(40)[None]
    want_cos, want_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = decoder_tables(cfg, 40)
    torch.testing.assert_close(cos, want_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, want_sin[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("factor", [0.25, 0.5, 1.0])
def test_partial_rotation_equals_apply_rotary_pos_emb(factor):
    rotary, _ = neox(64, factor)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 11, 64, generator=g), torch.randn(2, 3, 11, 64, generator=g)
    cos, sin = rotary(q, torch.arange(11)[None].expand(2, -1))
    want_q, want_k = modeling_gpt_neox.apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(apply_rope(q, cos[:, None], sin[:, None]), want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(apply_rope(k, cos[0], sin[0]), want_k, rtol=1e-6, atol=1e-6)


def test_linear_scaling_equals_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_theta=1e4
    )
    want, want_factor = ROPE_INIT_FUNCTIONS["linear"](config, "cpu")
    cfg = model_config("llama_tiny", rope_scaling="linear", rope_scaling_factor=4.0)
    from toolkit.models.common.rope import decoder_scaling

    got, factor = rope_frequencies(rotary_dim(cfg), cfg.rope_theta, decoder_scaling(cfg))
    assert factor == want_factor == 1.0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_a_partially_rotated_model_caches_exactly_and_leaves_the_rest_unrotated():
    registry.import_all_components()
    cfg = model_config("llama_tiny", max_target_positions=32, partial_rotary_factor=0.25)
    model = registry.resolve_arch("llama_tiny").cls(cfg, 40, padding_idx=1, seed=2).eval()
    assert model.rope_cos.shape == (32, 4)  # heads of 16, a quarter rotated
    x = torch.randint(4, 40, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, state = model(x), {}
        cached = torch.cat([model(x[:, :9], incremental_state=state), model(x[:, 9:], incremental_state=state)], 1)
        torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
        h = torch.randn(1, 1, 64).expand(1, 2, 64)  # the same input at positions 0 and 17
        q, (k, _), _ = model.layers[0].self_attn.project(h, model.rope_cos[[0, 17]], model.rope_sin[[0, 17]])
    assert torch.equal(q[:, :, 0, 4:], q[:, :, 1, 4:]) and torch.equal(k[:, :, 0, 4:], k[:, :, 1, 4:])
    assert not torch.allclose(q[:, :, 0, :4], q[:, :, 1, :4])


@pytest.mark.parametrize("factor", [0.0, 1.5, 0.35])
def test_impossible_factors_are_one_line(factor):
    """Nothing rotated, more than the head, or an odd width (int(20 x 0.35) = 7: its halves cannot pair up)."""
    from toolkit.models.common.options import check_shapes

    with pytest.raises(UserError, match=r"^--partial-rotary-factor .*: must be in \(0, 1\]") as e:
        check_shapes(model_config("llama_tiny", decoder_head_dim=20, partial_rotary_factor=factor))
    assert "\n" not in str(e.value)
