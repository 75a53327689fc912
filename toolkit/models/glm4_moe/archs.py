"""Named sizes of the GLM-4.5 family: the published configurations (Hugging Face ``config.json`` values of
zai-org/GLM-4.5 and zai-org/GLM-4.5-Air).

==========  ======  ====  ===  ===  ===  =====  ===  =  =====  ======  =====  =======  =======  ========
arch        layers  C     H    G    D    F      E    k  F_e    shared  dense  scaling  QK-norm  rotary
==========  ======  ====  ===  ===  ===  =====  ===  =  =====  ======  =====  =======  =======  ========
glm4_5      92      5120  96   8    128  12288  160  8  1536   1       3      2.5      yes      64 of 128
glm4_5_air  46      4096  96   8    128  10944  128  8  1408   1       1      1.0      no       64 of 128
==========  ======  ====  ===  ===  ===  =====  ===  =  =====  ======  =====  =======  =======  ========

(D: a head's features, of which ``partial_rotary_factor`` 0.5 rotate; F: the dense first layers' MLP width; F_e
an expert's; shared: shared experts of an expert's width; dense: the first layers with a dense MLP.) Both have
biases on q/k/v (``attention_bias``), route by sigmoid scores with the correction bias in one group,
renormalize the top k, rotary base 1e6, RMSNorm eps 1e-5, untied embeddings. Total and active parameters
(``tests/unit/test_glm4_moe.py`` counts them against transformers' model on the meta device; the
multi-token prediction layer not counted, the correction biases are buffers; active counts the embedding and
the output layer, 1.6 and 1.2 billion of them):

==========  ================  ===============
arch        total             active
==========  ================  ===============
glm4_5      352,797,814,784   33,632,251,904
glm4_5_air  106,852,245,504   13,424,123,904
==========  ================  ===============

``glm4_moe_tiny`` (head size 16 over a width of 32, half of it rotary, QK-norm, q/k/v biases, 8 experts in 2
groups, a shared expert, the first layer dense) is for tests; the bare ``glm4_moe`` is the options' own defaults
with GLM's router.
"""

from __future__ import annotations

from typing import Dict

from toolkit.core import registry
from toolkit.core.registry import register_model_architecture
from toolkit.models.common.options import set_shape
from toolkit.models.glm4_moe.config import Glm4MoeConfig

PUBLISHED_VOCAB_SIZE: Dict[str, int] = {"glm4_5": 151552, "glm4_5_air": 151552}
registry.PUBLISHED_VOCAB_SIZE.update(PUBLISHED_VOCAB_SIZE)


def _router(cfg: Glm4MoeConfig, experts: int, top_k: int, width: int, scaling: float) -> None:
    """GLM's router: sigmoid scores, the top k renormalized and scaled, the correction bias, no auxiliary loss;
    one shared expert of the routed experts' width."""
    cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_ffn_embed_dim, cfg.moe_shared_ffn_embed_dim = (
        experts,
        top_k,
        width,
        width,
    )
    cfg.moe_score_func, cfg.moe_renormalize, cfg.moe_routed_scaling_factor = "sigmoid", True, scaling
    cfg.moe_aux_loss_coef = 0.0


def _attention(cfg: Glm4MoeConfig, qk_norm: bool) -> None:
    """Heads of 128 with q/k/v biases, half of each rotated, base 1e6."""
    cfg.decoder_head_dim, cfg.partial_rotary_factor, cfg.attention_qkv_bias, cfg.qk_norm = 128, 0.5, True, qk_norm
    cfg.rope_theta, cfg.rms_norm_eps = 1000000.0, 1e-5


@register_model_architecture("glm4_moe", "glm4_moe")
def glm4_moe(cfg: Glm4MoeConfig) -> None:
    """The options' own defaults (a tiny model) with GLM's router; every size is a flag."""
    cfg.moe_score_func, cfg.moe_renormalize, cfg.moe_aux_loss_coef = "sigmoid", True, 0.0


@register_model_architecture("glm4_moe", "glm4_5")
def glm4_5(cfg: Glm4MoeConfig) -> None:
    """GLM-4.5 (355B-A32B): 92 layers, 160 experts of 1536 (8 a token), 3 dense first, QK-norm."""
    set_shape(cfg, layers=92, dim=5120, ffn=12288, heads=96, kv=8)
    _attention(cfg, qk_norm=True)
    _router(cfg, experts=160, top_k=8, width=1536, scaling=2.5)
    cfg.first_k_dense_replace = 3


@register_model_architecture("glm4_moe", "glm4_5_air")
def glm4_5_air(cfg: Glm4MoeConfig) -> None:
    """GLM-4.5-Air (106B-A12B): 46 layers, 128 experts of 1408 (8 a token), 1 dense first, no QK-norm."""
    set_shape(cfg, layers=46, dim=4096, ffn=10944, heads=96, kv=8)
    _attention(cfg, qk_norm=False)
    _router(cfg, experts=128, top_k=8, width=1408, scaling=1.0)
    cfg.first_k_dense_replace = 1


@register_model_architecture("glm4_moe", "glm4_moe_tiny")
def glm4_moe_tiny(cfg: Glm4MoeConfig) -> None:
    """For tests: 2 x 32, 4 heads of 16 on 2 key/value heads (8 rotary), QK-norm, q/k/v biases, 8 experts of 16
    in 2 groups (1 kept, top 2), a shared expert, the first layer dense."""
    set_shape(cfg, layers=2, dim=32, ffn=48, heads=4, kv=2)
    _attention(cfg, qk_norm=True)
    cfg.decoder_head_dim, cfg.rope_theta = 16, 10000.0
    _router(cfg, experts=8, top_k=2, width=16, scaling=2.5)
    cfg.moe_n_group, cfg.moe_topk_group, cfg.first_k_dense_replace = 2, 1, 1
