"""Named sizes of the MoE family: the published configurations (Hugging Face ``config.json`` values).

Total and active parameters at each model's own vocabulary; ``tests/unit/test_moe_family.py`` checks the totals
against transformers' own models built on the meta device from the published configs, and the active count
(what ``flops_per_token`` and MFU use) against a direct count of one token's experts.

==============  ======  ====  ===  ===  ===  =====  =====  =======  ==============  ==============
arch            layers  C     H    G    D    E      k      F        total           active
==============  ======  ====  ===  ===  ===  =====  =====  =======  ==============  ==============
qwen3_30b_a3b   48      2048  32   4    128  128    8      768      30,532,122,624   3,353,032,704
olmoe_1b_7b     16      2048  16   16   128  64     8      1024      6,919,161,856   1,282,017,280
mixtral_8x7b    32      4096  32   8    128  8      2      14336    46,702,792,704  12,879,925,248
==============  ======  ====  ===  ===  ===  =====  =====  =======  ==============  ==============

Qwen3-MoE renormalizes the top-k weights and has per-head QK-norm; OLMoE keeps the top-k softmax weights as
they are and normalizes the whole query and key projections; Mixtral renormalizes, no QK-norm. ``moe_tiny``,
``olmoe_tiny``, ``mixtral_tiny`` (4 experts, top 2) and ``moe_tiny_sigmoid`` (DeepSeek-V3's sigmoid router with
the aux-loss-free bias and a shared expert) are for tests.
"""

from __future__ import annotations

from typing import Dict

from toolkit.core import registry
from toolkit.core.registry import register_model_architecture
from toolkit.models.common.options import set_shape
from toolkit.models.moe.config import MoEConfig

PUBLISHED_VOCAB_SIZE: Dict[str, int] = {"qwen3_30b_a3b": 151936, "olmoe_1b_7b": 50304, "mixtral_8x7b": 32000}
registry.PUBLISHED_VOCAB_SIZE.update(PUBLISHED_VOCAB_SIZE)


def _shape(
    cfg: MoEConfig, layers: int, dim: int, heads: int, kv: int, experts: int, top_k: int, expert_ffn: int, ffn: int
) -> None:
    set_shape(cfg, layers=layers, dim=dim, ffn=ffn, heads=heads, kv=kv)
    cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_ffn_embed_dim = experts, top_k, expert_ffn


def _qwen3_moe(cfg: MoEConfig) -> None:
    """Qwen3-MoE: QK-norm per head, renormalized top-k, theta 1e6, RMSNorm eps 1e-6, aux coefficient 0.001."""
    cfg.qk_norm, cfg.moe_renormalize = True, True
    cfg.rope_theta, cfg.rms_norm_eps, cfg.moe_aux_loss_coef = 1000000.0, 1e-6, 0.001


def _olmoe(cfg: MoEConfig) -> None:
    """OLMoE: QK-norm over the whole projections, top-k weights as they are, aux 0.01 and router z-loss 0.001."""
    cfg.qk_norm, cfg.qk_norm_full_width, cfg.moe_renormalize = True, True, False
    cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef = 0.01, 0.001


def _mixtral(cfg: MoEConfig) -> None:
    """Mixtral: renormalized top-k, theta 1e6."""
    cfg.moe_renormalize, cfg.rope_theta = True, 1000000.0


@register_model_architecture("moe", "moe")
def moe(cfg: MoEConfig) -> None:
    """The options' own defaults (a tiny model); every size is a flag."""


@register_model_architecture("moe", "qwen3_30b_a3b")
def qwen3_30b_a3b(cfg: MoEConfig) -> None:
    """Qwen3-30B-A3B: 48 layers, 128 experts of width 768, 8 a token; heads of 128."""
    _shape(cfg, layers=48, dim=2048, heads=32, kv=4, experts=128, top_k=8, expert_ffn=768, ffn=6144)
    cfg.decoder_head_dim = 128
    _qwen3_moe(cfg)


@register_model_architecture("moe", "olmoe_1b_7b")
def olmoe_1b_7b(cfg: MoEConfig) -> None:
    """OLMoE-1B-7B (0924): 16 layers, 64 experts of width 1024, 8 a token."""
    _shape(cfg, layers=16, dim=2048, heads=16, kv=16, experts=64, top_k=8, expert_ffn=1024, ffn=1024)
    _olmoe(cfg)


@register_model_architecture("moe", "mixtral_8x7b")
def mixtral_8x7b(cfg: MoEConfig) -> None:
    """Mixtral 8x7B: 32 layers, 8 experts of width 14336, 2 a token."""
    _shape(cfg, layers=32, dim=4096, heads=32, kv=8, experts=8, top_k=2, expert_ffn=14336, ffn=14336)
    _mixtral(cfg)
    cfg.moe_aux_loss_coef = 0.02


@register_model_architecture("moe", "moe_tiny")
def moe_tiny(cfg: MoEConfig) -> None:
    """For tests: Qwen3-MoE-shaped, 2 x 64, 4 heads of 32 on 2 key/value heads, 4 experts of 32, top 2."""
    _shape(cfg, layers=2, dim=64, heads=4, kv=2, experts=4, top_k=2, expert_ffn=32, ffn=128)
    cfg.decoder_head_dim = 32
    _qwen3_moe(cfg)


@register_model_architecture("moe", "olmoe_tiny")
def olmoe_tiny(cfg: MoEConfig) -> None:
    """For tests: OLMoE-shaped, 2 x 64, 4 heads, 4 experts of 32, top 2."""
    _shape(cfg, layers=2, dim=64, heads=4, kv=4, experts=4, top_k=2, expert_ffn=32, ffn=32)
    _olmoe(cfg)


@register_model_architecture("moe", "mixtral_tiny")
def mixtral_tiny(cfg: MoEConfig) -> None:
    """For tests: Mixtral-shaped, 2 x 64, 4 heads on 2 key/value heads, 4 experts of 32, top 2."""
    _shape(cfg, layers=2, dim=64, heads=4, kv=2, experts=4, top_k=2, expert_ffn=32, ffn=32)
    _mixtral(cfg)


@register_model_architecture("moe", "moe_tiny_sigmoid")
def moe_tiny_sigmoid(cfg: MoEConfig) -> None:
    """For tests: DeepSeek-V3's router (sigmoid scores, renormalized, aux-loss-free bias) and a shared expert."""
    _shape(cfg, layers=2, dim=64, heads=4, kv=2, experts=4, top_k=2, expert_ffn=32, ffn=32)
    cfg.moe_score_func, cfg.moe_renormalize, cfg.moe_bias_update_rate = "sigmoid", True, 0.001
    cfg.moe_shared_ffn_embed_dim, cfg.moe_aux_loss_coef = 32, 0.0
