"""Options of the OLMo 2 family (``--arch olmo2`` and its named sizes): the rotary decoder options
(``toolkit.models.common.options``) and where its QK-norm spans:

``--qk-norm-over``              with --qk-norm: one RMSNorm over the whole q and k projections (``projection``,
                                OLMo 2's), or one per head (``head``)

Every block normalizes the outputs of the attention and the MLP before the residual add, not their inputs: what
makes the family, not an option.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Dict

from toolkit.models.common.options import DecoderOptions, absent_options


@dataclass
class Olmo2Config(DecoderOptions):
    ABSENT_OPTIONS: ClassVar[Dict[str, str]] = absent_options(
        "the OLMo 2 family", "OLMo 2 blocks always normalize the outputs of attention and the MLP (RMSNorm)"
    )

    qk_norm_over: str = field(
        default="projection",
        metadata={
            "choices": ["head", "projection"],
            "help": "--qk-norm over each head (Qwen3) or over the whole q and k projections (OLMo 2)",
        },
    )
