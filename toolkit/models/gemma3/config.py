"""Options of the Gemma family (``--arch gemma3`` and its named sizes): the rotary decoder options
(``toolkit.models.common.options``) and Gemma's own (Hugging Face's config key in brackets):

``--query-pre-attn-scalar``     attention scores scaled by 1/sqrt(this) (``query_pre_attn_scalar``)
``--rope-local-theta``          rotary base of the sliding_attention layers (``rope_local_base_freq``, transformers
                                5's ``rope_parameters.sliding_attention``)
``--attn-logit-softcap``        Gemma 2's cap * tanh(score / cap) on the attention scores (``attn_logit_softcapping``)
``--final-logit-softcap``       Gemma 2's cap * tanh(logit / cap) on the output logits (``final_logit_softcapping``)

Every block normalizes before and after both the attention and the MLP, each RMSNorm scaling by (1 + w), and the
embeddings are multiplied by sqrt(--decoder-embed-dim): what makes the family, not an option.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Dict, Optional

from toolkit.config.flag_types import positive_float
from toolkit.models.common.options import ROPE_BASE, DecoderOptions, absent_options


@dataclass
class Gemma3Config(DecoderOptions):
    ABSENT_OPTIONS: ClassVar[Dict[str, str]] = absent_options(
        "the Gemma family", "Gemma blocks always normalize before and after attention and the MLP (RMSNorm)"
    )

    query_pre_attn_scalar: Optional[float] = field(
        default=None,
        metadata={
            "type": positive_float,
            "help": "attention scores scaled by 1/sqrt(this) (Gemma; default: the head size)",
        },
    )
    rope_local_theta: Optional[float] = field(
        default=None,
        metadata={
            "type": ROPE_BASE,
            "help": "rotary base of the sliding_attention layers (Gemma 3's rope_local_base_freq; "
            "default: --rope-theta)",
        },
    )
    attn_logit_softcap: Optional[float] = field(
        default=None,
        metadata={"type": positive_float, "help": "attention scores capped by cap * tanh(score / cap) (Gemma 2)"},
    )
    final_logit_softcap: Optional[float] = field(
        default=None,
        metadata={"type": positive_float, "help": "output logits capped by cap * tanh(logit / cap) (Gemma 2)"},
    )


def attention_scale(cfg: Gemma3Config) -> Optional[float]:
    """1/sqrt(--query-pre-attn-scalar), else None: 1/sqrt(head size)."""
    return None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar**-0.5
