"""Options of the GLM-4.5 family (``--arch glm4_moe`` and its named sizes): the MoE family's options
(``toolkit.models.moe.config``: experts, router, aux-loss-free bias, losses) with the rotary decoder's attention
options (grouped-query heads, ``--partial-rotary-factor``, ``--qk-norm``, ``--attention-qkv-bias``) and
DeepSeekMoE's router and dense first layers, declared once by the DeepSeek-V3 family and taken from there
(Hugging Face's config key in brackets):

``--moe-n-group``                 groups of consecutive experts (``n_group``)
``--moe-topk-group``              a token's experts come from its best this many groups (``topk_group``)
``--moe-routed-scaling-factor``   the routed experts' weights multiplied by this (``routed_scaling_factor``)
``--first-k-dense-replace``       the first this many layers have a dense MLP (``first_k_dense_replace``)
``--mtp-depth``                   multi-token prediction depths after the decoder (``num_nextn_predict_layers``;
                                  ``toolkit.models.common.mtp``), trained only; 0: none
``--mtp-loss-coef``               their mean loss's weight in the training loss, logged as ``mtp_loss``
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict

from toolkit.core.errors import UserError
from toolkit.models.common.options import absent_options
from toolkit.models.deepseek_v3.config import deepseek_option
from toolkit.models.moe.config import MoEConfig, check_moe_shapes


@dataclass
class Glm4MoeConfig(MoEConfig):
    ABSENT_OPTIONS: ClassVar[Dict[str, str]] = absent_options(
        "the GLM-4.5 family", "GLM-4.5 blocks always normalize before attention and the MLP (RMSNorm)"
    )

    moe_n_group: int = deepseek_option("moe_n_group")
    moe_topk_group: int = deepseek_option("moe_topk_group")
    moe_routed_scaling_factor: float = deepseek_option("moe_routed_scaling_factor")
    first_k_dense_replace: int = deepseek_option("first_k_dense_replace")
    mtp_depth: int = deepseek_option("mtp_depth")
    mtp_loss_coef: float = deepseek_option("mtp_loss_coef")


def check_glm_shapes(cfg: Glm4MoeConfig) -> None:
    """The MoE family's checks (attention included), then the groups' and the dense layers' (one line each)."""
    check_moe_shapes(cfg)
    E, groups, top = cfg.moe_num_experts, cfg.moe_n_group, cfg.moe_topk_group
    if E % groups or top > groups or (groups > 1 and cfg.moe_top_k > top * (E // groups)):
        raise UserError(
            f"--moe-n-group {groups} / --moe-topk-group {top}: the groups must divide the {E} experts "
            f"(--moe-num-experts), the kept groups be no more than the groups and hold the --moe-top-k "
            f"{cfg.moe_top_k} experts"
        )
    if not 0 <= cfg.first_k_dense_replace <= cfg.decoder_layers:
        raise UserError(
            f"--first-k-dense-replace {cfg.first_k_dense_replace}: between 0 and the {cfg.decoder_layers} layers"
        )
