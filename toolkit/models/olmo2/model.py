"""The OLMo 2 decoder: ``common/rotary_decoder.py``'s model with blocks that normalize the outputs of attention and
the MLP (``NormAfterBlock``), QK-norm over the whole q and k projections (``--qk-norm-over projection``, the
family's default) or per head, SwiGLU, RMSNorm everywhere."""

from __future__ import annotations

from typing import Optional

from toolkit.core.registry import register_model
from toolkit.models.common.blocks import NormAfterBlock
from toolkit.models.common.rotary_decoder import RotaryDecoderLM, decoder_attention
from toolkit.models.olmo2.config import Olmo2Config
from toolkit.models.olmo2.hf import Olmo2Adapter
from toolkit.models.olmo2.parallel import tensor_parallel_plan


@register_model("olmo2", dataclass=Olmo2Config)
class Olmo2LanguageModel(RotaryDecoderLM):
    """The decoder-only OLMo 2 language model behind the toolkit's model interface."""

    HF_ADAPTER = Olmo2Adapter
    PLAN = staticmethod(tensor_parallel_plan)

    def build_block(self, cfg: Olmo2Config, index: int, window: Optional[int]) -> NormAfterBlock:
        attention = decoder_attention(cfg, window, qk_norm_per_head=cfg.qk_norm_over == "head")
        return NormAfterBlock(attention, self.gated_mlp(), norm=self.width_norm)
