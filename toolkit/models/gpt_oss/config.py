"""Options of the gpt-oss family (``--arch gpt_oss`` and its named sizes): the MoE family's options
(``toolkit.models.moe.config``: experts, router, losses) and gpt-oss's own (Hugging Face's config key in brackets):

``--moe-swiglu-limit``   the experts' SwiGLU clamps its gate above and its up projection on both sides at this
                         value (``swiglu_limit``)
``--moe-swiglu-alpha``   the gate's sigmoid gain: gate * sigmoid(alpha * gate) (``swiglu_alpha``)

What the family always has, as every gpt-oss checkpoint: biases on q, k, v and the output projection
(``attention_bias``), one learned sink logit per head in each softmax, a bias on the router's logits, biases on
the experts' projections; the router takes the top k logits and the softmax over those k. The local layers
(``--layer-types``, ``--sliding-window``) alternate with global ones in the named sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Dict

from toolkit.config.flag_types import positive_float
from toolkit.core.errors import UserError
from toolkit.models.common.options import absent_options
from toolkit.models.moe.config import MoEConfig, check_moe_shapes


@dataclass
class GptOssConfig(MoEConfig):
    ABSENT_OPTIONS: ClassVar[Dict[str, str]] = absent_options(
        "the gpt-oss family", "gpt-oss blocks always normalize before attention and the experts (RMSNorm)"
    )

    moe_swiglu_limit: float = field(
        default=7.0,
        metadata={
            "type": positive_float,
            "help": "the experts' SwiGLU: gate clamped above, up projection clamped on both sides at this value",
        },
    )
    moe_swiglu_alpha: float = field(
        default=1.702,
        metadata={"type": positive_float, "help": "the experts' SwiGLU: out = (up + 1) * gate * sigmoid(alpha gate)"},
    )


def check_gpt_oss_shapes(cfg: GptOssConfig) -> None:
    """The MoE family's checks; the router's softmax over the top k and the SwiGLU's settings (one line each)."""
    check_moe_shapes(cfg)
    if cfg.moe_score_func != "softmax" or cfg.moe_shared_ffn_embed_dim or cfg.moe_bias_update_rate:
        raise UserError(
            "--arch gpt_oss: its router is a softmax over the top-k logits, with no shared expert and no "
            "aux-loss-free bias (--moe-score-func softmax, --moe-shared-ffn-embed-dim 0, --moe-bias-update-rate 0)"
        )
    if not cfg.attention_qkv_bias:
        raise UserError("--arch gpt_oss: its attention has biases on q, k, v and o (--attention-qkv-bias)")
    if cfg.mlp_activation != "silu":
        raise UserError(f"--mlp-activation {cfg.mlp_activation}: gpt-oss's experts are its clamped SwiGLU (silu)")
    for name in ("moe_swiglu_limit", "moe_swiglu_alpha"):
        if not getattr(cfg, name) > 0:  # a config not parsed from flags (a checkpoint's)
            raise UserError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be above 0")
