"""Named sizes of the DeepSeek-V3 family: the published configurations (Hugging Face ``config.json`` values).

=================  ======  ====  ===  ====  ====  ===  =====  ===  ====  ======  ======  ======  =======  ==========
arch               layers  C     H    q r   kv r  Dr   Dn/Dv  E    k     groups  shared  dense   scaling  YaRN
=================  ======  ====  ===  ====  ====  ===  =====  ===  ====  ======  ======  ======  =======  ==========
deepseek_v3_671b   61      7168  128  1536  512   64   128    256  8     8 / 4   1       3       2.5      40 x 4096
moonlight_16b_a3b  27      2048  16   -     512   64   128    64   6     1 / 1   2       1       2.446    none
kimi_k2            61      7168  64   1536  512   64   128    384  8     1 / 1   1       1       2.827    32 x 4096
=================  ======  ====  ===  ====  ====  ===  =====  ===  ====  ======  ======  ======  =======  ==========

(q r, kv r: the query and latent ranks; Dr the rotary part of a query/key head, Dn its unrotated part, Dv a value
head; groups: ``n_group`` / ``topk_group``; shared: shared experts of the routed experts' width; dense: the first
layers with a dense MLP; YaRN: factor x original context.) Every one routes by sigmoid scores, renormalizes the
top k, keeps the correction bias and sharpens its logits by YaRN's mscale over all features (``mscale_all_dim`` 1).
Total and active parameters (``tests/unit/test_deepseek_v3.py`` counts them on the meta device):

=================  ==================  ================
arch               total               active
=================  ==================  ================
deepseek_v3_671b   671,026,404,352     37,552,282,624
moonlight_16b_a3b  15,960,108,544      2,914,774,528
kimi_k2            1,026,408,209,408   32,861,477,888
=================  ==================  ================

(Parameters at each model's own vocabulary, the correction biases not counted: they are buffers, 256 a layer in
DeepSeek-V3, whose 671,026,419,200 counts them; the multi-token prediction module not counted either.)

``deepseek_v3_tiny`` (the q low rank, 8 experts in 2 groups, a shared expert, the first layer dense, YaRN) is for
tests; the bare ``deepseek_v3`` is the options' own defaults with DeepSeek's router.
"""

from __future__ import annotations

from typing import Dict, Optional

from toolkit.core import registry
from toolkit.core.registry import register_model_architecture
from toolkit.models.common.options import set_shape
from toolkit.models.deepseek_v3.config import DeepSeekV3Config

PUBLISHED_VOCAB_SIZE: Dict[str, int] = {"deepseek_v3_671b": 129280, "moonlight_16b_a3b": 163840, "kimi_k2": 163840}
registry.PUBLISHED_VOCAB_SIZE.update(PUBLISHED_VOCAB_SIZE)


def _router(cfg: DeepSeekV3Config, experts: int, top_k: int, groups: int, kept: int, scaling: float) -> None:
    """DeepSeekMoE's router: sigmoid scores, the top k renormalized and scaled, groups, no auxiliary loss."""
    cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_n_group, cfg.moe_topk_group = experts, top_k, groups, kept
    cfg.moe_score_func, cfg.moe_renormalize, cfg.moe_routed_scaling_factor = "sigmoid", True, scaling
    cfg.moe_aux_loss_coef = 0.0


def _latent(cfg: DeepSeekV3Config, q_rank: Optional[int], kv_rank: int, rope: int, nope: int, v: int) -> None:
    cfg.q_lora_rank, cfg.kv_lora_rank, cfg.decoder_head_dim = q_rank, kv_rank, rope
    cfg.qk_nope_head_dim, cfg.v_head_dim = nope, v


def _yarn(cfg: DeepSeekV3Config, factor: float, beta_fast: float) -> None:
    """YaRN over an original context of 4096, mscale 1 over all features (the tables' own factor is then 1)."""
    cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_original_max_positions = "yarn", factor, 4096
    cfg.rope_yarn_beta_fast, cfg.rope_yarn_beta_slow, cfg.rope_attention_factor = beta_fast, 1.0, 1.0
    cfg.rope_mscale_all_dim = 1.0


@register_model_architecture("deepseek_v3", "deepseek_v3")
def deepseek_v3(cfg: DeepSeekV3Config) -> None:
    """The options' own defaults (a tiny model) with DeepSeek's router; every size is a flag."""
    _router(cfg, cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_n_group, cfg.moe_topk_group, 1.0)


@register_model_architecture("deepseek_v3", "deepseek_v3_671b")
def deepseek_v3_671b(cfg: DeepSeekV3Config) -> None:
    """DeepSeek-V3 (and V3.1/R1's shapes): 61 layers, 256 experts of 2048 in 8 groups, 8 a token, 3 dense first."""
    set_shape(cfg, layers=61, dim=7168, ffn=18432, heads=128, kv=128)
    _latent(cfg, q_rank=1536, kv_rank=512, rope=64, nope=128, v=128)
    _router(cfg, experts=256, top_k=8, groups=8, kept=4, scaling=2.5)
    cfg.moe_ffn_embed_dim, cfg.moe_shared_ffn_embed_dim, cfg.first_k_dense_replace = 2048, 2048, 3
    cfg.rms_norm_eps = 1e-6
    _yarn(cfg, factor=40.0, beta_fast=32.0)


@register_model_architecture("deepseek_v3", "moonlight_16b_a3b")
def moonlight_16b_a3b(cfg: DeepSeekV3Config) -> None:
    """Moonlight-16B-A3B: 27 layers, no query low rank, 64 experts of 1408 (6 a token), 2 shared, theta 5e4."""
    set_shape(cfg, layers=27, dim=2048, ffn=11264, heads=16, kv=16)
    _latent(cfg, q_rank=None, kv_rank=512, rope=64, nope=128, v=128)
    _router(cfg, experts=64, top_k=6, groups=1, kept=1, scaling=2.446)
    cfg.moe_ffn_embed_dim, cfg.moe_shared_ffn_embed_dim, cfg.first_k_dense_replace = 1408, 2816, 1
    cfg.rms_norm_eps, cfg.rope_theta = 1e-5, 50000.0


@register_model_architecture("deepseek_v3", "kimi_k2")
def kimi_k2(cfg: DeepSeekV3Config) -> None:
    """Kimi K2: DeepSeek-V3's shapes with 64 heads, 384 experts in one group, 1 dense layer, theta 5e4."""
    set_shape(cfg, layers=61, dim=7168, ffn=18432, heads=64, kv=64)
    _latent(cfg, q_rank=1536, kv_rank=512, rope=64, nope=128, v=128)
    _router(cfg, experts=384, top_k=8, groups=1, kept=1, scaling=2.827)
    cfg.moe_ffn_embed_dim, cfg.moe_shared_ffn_embed_dim, cfg.first_k_dense_replace = 2048, 2048, 1
    cfg.rms_norm_eps, cfg.rope_theta = 1e-6, 50000.0
    _yarn(cfg, factor=32.0, beta_fast=1.0)


@register_model_architecture("deepseek_v3", "deepseek_v3_tiny")
def deepseek_v3_tiny(cfg: DeepSeekV3Config) -> None:
    """For tests: 3 x 64, 4 heads, q rank 24, latent 16, rotary 8, 8 experts of 32 in 2 groups (1 kept, top 2),
    a shared expert, the first layer dense, YaRN 4 x 16."""
    set_shape(cfg, layers=3, dim=64, ffn=96, heads=4, kv=4)
    _latent(cfg, q_rank=24, kv_rank=16, rope=8, nope=16, v=12)
    _router(cfg, experts=8, top_k=2, groups=2, kept=1, scaling=2.5)
    cfg.moe_ffn_embed_dim, cfg.moe_shared_ffn_embed_dim, cfg.first_k_dense_replace = 32, 32, 1
    cfg.rms_norm_eps = 1e-6
    cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_original_max_positions = "yarn", 4.0, 16
    cfg.rope_mscale_all_dim = 1.0
