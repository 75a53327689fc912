"""Named sizes of the Qwen3-Next family: the published configuration (Hugging Face ``config.json`` values).

=================  ======  ====  ===  ===  ===  =====  ==  ===  ======  =======  =======  ===============
arch               layers  C     H    G    D    E      k   F    shared  Hk x Dk  Hv x Dv  total
=================  ======  ====  ===  ===  ===  =====  ==  ===  ======  =======  =======  ===============
qwen3_next_80b_a3b 48      2048  16   2    256  512    10  512  512     16 x 128 32 x 128 79,674,391,296
=================  ======  ====  ===  ===  ===  =====  ==  ===  ======  =======  =======  ===============

Every fourth layer is gated full attention (a quarter of each head rotated, theta 1e7), the others gated DeltaNet;
``tests/unit/test_qwen3_next.py`` checks the total against transformers' model built on the meta device.
``qwen3_next_tiny``, ``qwen3_5_moe_tiny`` and ``qwen3_5_tiny`` (Qwen3.5's split projections; the last with dense
MLPs) are for tests; Qwen3.5's published sizes are not named yet.
"""

from __future__ import annotations

from toolkit.core import registry
from toolkit.core.registry import register_model_architecture
from toolkit.models.common.options import set_shape
from toolkit.models.qwen3_next.config import Qwen3NextConfig

registry.PUBLISHED_VOCAB_SIZE.update({"qwen3_next_80b_a3b": 151936})


def _qwen3_next(cfg: Qwen3NextConfig) -> None:
    """Qwen3-Next's fixed choices: QK-norm per head, renormalized top-k, a quarter of each head rotated, eps 1e-6."""
    cfg.qk_norm, cfg.moe_renormalize, cfg.partial_rotary_factor = True, True, 0.25
    cfg.rms_norm_eps, cfg.moe_aux_loss_coef, cfg.full_attention_interval = 1e-6, 0.001, 4


@register_model_architecture("qwen3_next", "qwen3_next")
def qwen3_next(cfg: Qwen3NextConfig) -> None:
    """The options' own defaults (a tiny model) with Qwen3-Next's fixed choices and a shared expert as wide as an
    expert; every size is a flag."""
    _qwen3_next(cfg)
    cfg.moe_shared_ffn_embed_dim = cfg.moe_ffn_embed_dim


@register_model_architecture("qwen3_next", "qwen3_next_80b_a3b")
def qwen3_next_80b_a3b(cfg: Qwen3NextConfig) -> None:
    """Qwen3-Next-80B-A3B: 48 layers (12 full attention), 512 experts of width 512, 10 a token, a shared one."""
    set_shape(cfg, layers=48, dim=2048, ffn=5120, heads=16, kv=2)
    cfg.decoder_head_dim, cfg.rope_theta = 256, 10000000.0
    cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_ffn_embed_dim, cfg.moe_shared_ffn_embed_dim = 512, 10, 512, 512
    cfg.linear_num_key_heads, cfg.linear_num_value_heads = 16, 32
    cfg.linear_key_head_dim = cfg.linear_value_head_dim = 128
    _qwen3_next(cfg)


@register_model_architecture("qwen3_next", "qwen3_next_tiny")
def qwen3_next_tiny(cfg: Qwen3NextConfig) -> None:
    """For tests: 4 layers of 32 (the last full attention: 4 heads of 8 on 2), 4 experts of 16, top 2, a shared
    expert of 24, gated DeltaNet with 2 key heads of 8 and 4 value heads of 6."""
    set_shape(cfg, layers=4, dim=32, ffn=48, heads=4, kv=2)
    cfg.decoder_head_dim = 8
    cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_ffn_embed_dim, cfg.moe_shared_ffn_embed_dim = 4, 2, 16, 24
    cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim = (
        2,
        4,
        8,
        6,
    )
    _qwen3_next(cfg)
    cfg.partial_rotary_factor = 0.5


@register_model_architecture("qwen3_next", "qwen3_5_moe_tiny")
def qwen3_5_moe_tiny(cfg: Qwen3NextConfig) -> None:
    """For tests: ``qwen3_next_tiny`` as Qwen3.5's MoE models lay it out (the linear layers' projections split)."""
    qwen3_next_tiny(cfg)
    cfg.linear_split_projections = True


@register_model_architecture("qwen3_next", "qwen3_5_tiny")
def qwen3_5_tiny(cfg: Qwen3NextConfig) -> None:
    """For tests: a dense Qwen3.5 (``qwen3_5_moe_tiny`` with a SwiGLU of 48 in every layer)."""
    qwen3_5_moe_tiny(cfg)
    cfg.dense_mlp = True
