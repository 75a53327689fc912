"""Options of the DeepSeek-V3 family (``--arch deepseek_v3`` and its named sizes): the MoE family's options
(``toolkit.models.moe.config``: experts, router, aux-loss-free bias, losses) and DeepSeek's own (Hugging Face's
config key in brackets):

``--q-lora-rank``                 queries through a low rank with its RMSNorm (``q_lora_rank``; none: one
                                  projection)
``--kv-lora-rank``                the compressed latent a position leaves for keys and values (``kv_lora_rank``)
``--qk-nope-head-dim``            each query/key head's features without rotation (``qk_nope_head_dim``)
``--v-head-dim``                  each value head's features (``v_head_dim``)
``--decoder-head-dim``            the decoupled rotary features of each query head and of the key part shared by
                                  the heads (``qk_rope_head_dim``, which Hugging Face's config also calls
                                  ``head_dim``): the rotary tables are this wide
``--moe-n-group``                 groups of consecutive experts (``n_group``); a token's experts come from
``--moe-topk-group``              its best this many groups (``topk_group``)
``--moe-routed-scaling-factor``   the routed experts' weights multiplied by this (``routed_scaling_factor``)
``--first-k-dense-replace``       the first this many layers have a dense MLP of ``--decoder-ffn-embed-dim``
                                  (``first_k_dense_replace``), the others experts
``--rope-mscale-all-dim``         YaRN's logit sharpening over every query/key feature, in the softmax scale
                                  (``rope_scaling.mscale_all_dim``; 0: none)
``--moe-seq-aux-loss-coef``       DeepSeek-V3's sequence-wise balance loss (its alpha; logged as
                                  ``moe_seq_aux_loss``, ``common.moe.sequence_balance_loss``); 0: none
``--mtp-depth``                   multi-token prediction depths after the decoder (``num_nextn_predict_layers``;
                                  ``toolkit.models.common.mtp``), trained only; 0: none
``--mtp-loss-coef``               their mean loss's weight in the training loss (DeepSeek-V3's lambda: 0.3 for
                                  its first 10T tokens, 0.1 after; Megatron's ``--mtp-loss-scaling-factor`` 0.1)

The experts' router is DeepSeek's where the arch says so (sigmoid scores, renormalized top-k, the correction
bias kept whether or not ``--moe-bias-update-rate`` moves it); shared experts are ``--moe-shared-ffn-embed-dim``
wide (``n_shared_experts`` x ``moe_intermediate_size``).
"""

from __future__ import annotations

import copy
from dataclasses import Field, dataclass, field
from typing import ClassVar, Dict, Optional

from toolkit.config.flag_types import non_negative_int, positive_int
from toolkit.core.errors import UserError
from toolkit.models.common.options import absent_options, head_dim, rotary_dim
from toolkit.models.moe.config import MoEConfig, check_moe_shapes


@dataclass
class DeepSeekV3Config(MoEConfig):
    ABSENT_OPTIONS: ClassVar[Dict[str, str]] = absent_options(
        "the DeepSeek-V3 family", "DeepSeek-V3 blocks always normalize before attention and the MLP (RMSNorm)"
    )

    q_lora_rank: Optional[int] = field(
        default=None,
        metadata={"type": positive_int, "help": "rank of the queries' low-rank projection (default: none)"},
    )
    kv_lora_rank: int = field(
        default=32, metadata={"type": positive_int, "help": "features of the latent a position caches for k and v"}
    )
    qk_nope_head_dim: int = field(
        default=16, metadata={"type": positive_int, "help": "features of each query/key head without rotation"}
    )
    v_head_dim: int = field(default=16, metadata={"type": positive_int, "help": "features of each value head"})
    moe_n_group: int = field(
        default=1, metadata={"type": positive_int, "help": "groups of consecutive experts (DeepSeek-V3: 8)"}
    )
    moe_topk_group: int = field(
        default=1,
        metadata={"type": positive_int, "help": "a token's experts come from its best this many groups (4)"},
    )
    moe_routed_scaling_factor: float = field(
        default=1.0, metadata={"help": "the routed experts' weights multiplied by this (DeepSeek-V3: 2.5)"}
    )
    first_k_dense_replace: int = field(
        default=0, metadata={"help": "the first this many layers have a dense MLP instead of experts (3)"}
    )
    rope_mscale_all_dim: float = field(
        default=0.0,
        metadata={"help": "YaRN: the softmax scale times (0.1 this ln(--rope-scaling-factor) + 1)^2 (DeepSeek: 1)"},
    )
    moe_seq_aux_loss_coef: float = field(
        default=0.0,
        metadata={"help": "weight of DeepSeek-V3's sequence-wise balance loss, logged as moe_seq_aux_loss (V3: 1e-4)"},
    )
    mtp_depth: int = field(
        default=0,
        metadata={"type": non_negative_int, "help": "multi-token prediction depths, trained only (DeepSeek-V3: 1)"},
    )
    mtp_loss_coef: float = field(
        default=0.1,
        metadata={
            "help": "weight of the mean multi-token prediction loss, logged as mtp_loss (DeepSeek-V3: 0.3, then 0.1)"
        },
    )


def deepseek_option(name: str) -> Field:
    """Option ``name`` as this family declares it (default, type, help), for a family that shares it (GLM-4.5's
    router, the multi-token prediction depths of GLM-4.5 and Qwen3-Next): one declaration."""
    return copy.copy(DeepSeekV3Config.__dataclass_fields__[name])


def qk_head_dim(cfg: DeepSeekV3Config) -> int:
    """A query/key head's features: the unrotated part and the rotary part."""
    return cfg.qk_nope_head_dim + head_dim(cfg)


def check_deepseek_shapes(cfg: DeepSeekV3Config) -> None:
    """The MoE family's checks, then latent attention's and the groups' (one line each)."""
    check_moe_shapes(cfg)
    if cfg.qk_norm or cfg.attention_qkv_bias or rotary_dim(cfg) != head_dim(cfg):
        raise UserError(
            "--qk-norm / --attention-qkv-bias / --partial-rotary-factor: latent attention has none of them "
            "(its rotary part is --decoder-head-dim features, rotated whole)"
        )
    E, groups, top = cfg.moe_num_experts, cfg.moe_n_group, cfg.moe_topk_group
    if E % groups or top > groups:
        raise UserError(
            f"--moe-n-group {groups} / --moe-topk-group {top}: the groups must divide the {E} experts "
            "(--moe-num-experts) and the kept groups be no more than the groups"
        )
    if groups > 1 and cfg.moe_top_k > top * (E // groups):
        raise UserError(
            f"--moe-top-k {cfg.moe_top_k}: more than the {top * (E // groups)} experts of the "
            f"--moe-topk-group {top} kept groups"
        )
    if not 0 <= cfg.first_k_dense_replace <= cfg.decoder_layers:
        raise UserError(
            f"--first-k-dense-replace {cfg.first_k_dense_replace}: between 0 and the {cfg.decoder_layers} layers"
        )
