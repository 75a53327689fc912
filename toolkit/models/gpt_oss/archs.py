"""Named sizes of the gpt-oss family: the published configurations (Hugging Face ``config.json`` values).

==============  ======  ====  ===  ===  ===  =====  =====  ====  ==============  ==============
arch            layers  C     H    G    D    E      k      F     total           active
==============  ======  ====  ===  ===  ===  =====  =====  ====  ==============  ==============
gpt_oss_20b     24      2880  64   8    64   32     4      2880  20,914,757,184   4,187,440,704
gpt_oss_120b    36      2880  64   8    64   128    4      2880  116,829,156,672  5,711,982,912
==============  ======  ====  ===  ===  ===  =====  =====  ====  ==============  ==============

Both: vocabulary 201,088 (o200k_harmony), untied output layer, local layers (window 128) alternating with global
ones from the first, rotary base 150,000 with YaRN (factor 32 over 4,096 positions, betas 32/1, the ramp's ends
not rounded: ``truncate`` false), RMSNorm epsilon 1e-5, the SwiGLU clamped at 7 with alpha 1.702.
Active counts include the embedding and the output layer (as the MoE family's). ``tests/unit/test_gpt_oss_family.py``
checks the totals against transformers' models built on the meta device. ``gpt_oss_tiny`` (2 layers of 32, 4
experts of 32, top 2, window 4) is for tests.
"""

from __future__ import annotations

from toolkit.core import registry
from toolkit.core.registry import register_model_architecture
from toolkit.models.common.options import set_shape
from toolkit.models.gpt_oss.config import GptOssConfig

VOCAB_SIZE = 201088
registry.PUBLISHED_VOCAB_SIZE.update({"gpt_oss_20b": VOCAB_SIZE, "gpt_oss_120b": VOCAB_SIZE})


def alternating(layers: int) -> str:
    """``--layer-types`` of gpt-oss: local, global, local, ... (transformers' default ``layer_types``)."""
    return ",".join("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))


def _gpt_oss(cfg: GptOssConfig, layers: int, experts: int, window: int) -> None:
    """The settings the released sizes share; ``layers`` and ``experts`` differ."""
    set_shape(cfg, layers=layers, dim=2880, ffn=2880, heads=64, kv=8)
    cfg.decoder_head_dim, cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_ffn_embed_dim = 64, experts, 4, 2880
    cfg.sliding_window, cfg.layer_types = window, alternating(layers)
    _rope_and_router(cfg)


def _rope_and_router(cfg: GptOssConfig) -> None:
    cfg.rope_theta, cfg.rope_scaling, cfg.rope_scaling_factor = 150000.0, "yarn", 32.0
    cfg.rope_original_max_positions, cfg.rope_yarn_truncate = 4096, False
    cfg.rope_yarn_beta_fast, cfg.rope_yarn_beta_slow = 32.0, 1.0
    cfg.rms_norm_eps, cfg.moe_renormalize, cfg.moe_aux_loss_coef = 1e-5, True, 0.001
    cfg.attention_qkv_bias = True


@register_model_architecture("gpt_oss", "gpt_oss")
def gpt_oss(cfg: GptOssConfig) -> None:
    """The options' own defaults (a tiny model); every size is a flag."""
    cfg.moe_renormalize, cfg.attention_qkv_bias = True, True


@register_model_architecture("gpt_oss", "gpt_oss_20b")
def gpt_oss_20b(cfg: GptOssConfig) -> None:
    """gpt-oss-20b: 24 layers, 32 experts of width 2880, 4 a token."""
    _gpt_oss(cfg, layers=24, experts=32, window=128)


@register_model_architecture("gpt_oss", "gpt_oss_120b")
def gpt_oss_120b(cfg: GptOssConfig) -> None:
    """gpt-oss-120b: 36 layers, 128 experts of width 2880, 4 a token."""
    _gpt_oss(cfg, layers=36, experts=128, window=128)


@register_model_architecture("gpt_oss", "gpt_oss_tiny")
def gpt_oss_tiny(cfg: GptOssConfig) -> None:
    """For tests: 2 x 32, 4 heads of 8 on 2 key/value heads, 4 experts of 32 (MXFP4's block), top 2, a local layer
    (window 4) then a global one, YaRN as released."""
    set_shape(cfg, layers=2, dim=32, heads=4, kv=2, ffn=32)
    cfg.decoder_head_dim, cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_ffn_embed_dim = 8, 4, 2, 32
    cfg.sliding_window, cfg.layer_types = 4, alternating(2)
    _rope_and_router(cfg)
