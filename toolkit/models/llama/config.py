"""Options of the Llama family (``--arch llama`` and its named sizes: Llama 2/3, Mistral, Qwen2, Qwen3,
TinyLlama): the options every rotary decoder family shares (``toolkit.models.common.options``), nothing more.
Its blocks normalize before attention and before the MLP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict

from toolkit.models.common.options import DecoderOptions, absent_options
from toolkit.models.common.options import head_dim, kv_heads  # noqa: F401  (the family's head sizes, by its name)

GEMMA = "Gemma's norms, score scale, soft-caps and local rotary base are the gemma3 family's (--arch gemma3)"
OLMO2 = "norms after the sublayers and QK-norm over the projections are the olmo2 family's (--arch olmo2)"


@dataclass
class LlamaConfig(DecoderOptions):
    ABSENT_OPTIONS: ClassVar[Dict[str, str]] = {
        **absent_options("the Llama family", "Llama blocks always normalize before attention and the MLP (RMSNorm)"),
        **{
            name: GEMMA
            for name in (
                "gemma_norms",
                "query_pre_attn_scalar",
                "rope_local_theta",
                "attn_logit_softcap",
                "final_logit_softcap",
            )
        },
        **{name: OLMO2 for name in ("norm_after_sublayer", "qk_norm_over")},
    }
