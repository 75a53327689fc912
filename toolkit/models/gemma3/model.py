"""The Gemma decoder (Gemma 2/3 text): ``common/rotary_decoder.py``'s model with sandwich blocks
(``SandwichBlock``: a norm before and after both sublayers), every RMSNorm scaling by (1 + w) (QK-norm too),
the GeGLU MLP, scores scaled by 1/sqrt(--query-pre-attn-scalar) and optionally soft-capped, embeddings times
sqrt(width), the logits optionally soft-capped, and local layers rotating with their own base
(--rope-local-theta).
"""

from __future__ import annotations

from typing import Optional

from toolkit.core.registry import register_model
from toolkit.models.common.attention import Attention
from toolkit.models.common.blocks import SandwichBlock
from toolkit.models.common.rotary_decoder import RotaryDecoderLM, decoder_attention
from toolkit.models.gemma3.config import Gemma3Config, attention_scale
from toolkit.models.gemma3.hf import Gemma3Adapter
from toolkit.models.gemma3.parallel import tensor_parallel_plan


def gemma_attention(cfg: Gemma3Config, window: Optional[int]) -> Attention:
    """Grouped-query attention with Gemma's score scale and soft-cap; its QK-norm scales by (1 + w) too."""
    return decoder_attention(
        cfg, window, softcap=cfg.attn_logit_softcap, scale=attention_scale(cfg), qk_norm_unit_offset=True
    )


@register_model("gemma3", dataclass=Gemma3Config)
class Gemma3LanguageModel(RotaryDecoderLM):
    """The decoder-only Gemma 2 / Gemma 3 (text) language model behind the toolkit's model interface."""

    unit_offset_norms = True
    HF_ADAPTER = Gemma3Adapter
    PLAN = staticmethod(tensor_parallel_plan)

    def build_block(self, cfg: Gemma3Config, index: int, window: Optional[int]) -> SandwichBlock:
        return SandwichBlock(gemma_attention(cfg, window), self.gated_mlp(), norm=self.width_norm)

    @staticmethod
    def local_rope_theta(cfg: Gemma3Config) -> Optional[float]:
        return cfg.rope_local_theta

    def embed_scale(self) -> Optional[float]:
        return self.cfg.decoder_embed_dim**0.5

    def logit_softcap(self) -> Optional[float]:
        return self.cfg.final_logit_softcap
