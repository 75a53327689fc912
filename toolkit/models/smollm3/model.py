"""The SmolLM3 decoder: the Llama family's (``toolkit.models.llama.model``: pre-norm blocks, grouped-query
attention, SwiGLU) whose NoPE layers (``--nope-layer-interval``, ``--nope-layers``) attend without rotating q and
k: their positions come from the causal mask alone. Every other path (the KV cache, context parallelism, the ONNX
cached decoder) runs the same attention, so a NoPE layer is NoPE in each."""

from __future__ import annotations

from typing import Optional

from toolkit.core.registry import register_model
from toolkit.models.common.blocks import PreNormBlock
from toolkit.models.common.rotary_decoder import decoder_attention
from toolkit.models.llama.model import LlamaLanguageModel
from toolkit.models.smollm3.config import SmolLM3Config, nope_layers
from toolkit.models.smollm3.hf import SmolLM3Adapter
from toolkit.models.smollm3.parallel import tensor_parallel_plan


@register_model("smollm3", dataclass=SmolLM3Config)
class SmolLM3LanguageModel(LlamaLanguageModel):
    """The decoder-only SmolLM3 language model behind the toolkit's model interface."""

    HF_ADAPTER = SmolLM3Adapter
    PLAN = staticmethod(tensor_parallel_plan)

    @staticmethod
    def check_options(cfg: SmolLM3Config) -> None:
        LlamaLanguageModel.check_options(cfg)
        nope_layers(cfg)

    def build_block(self, cfg: SmolLM3Config, index: int, window: Optional[int]) -> PreNormBlock:
        attention = decoder_attention(cfg, window, rotary=index not in nope_layers(cfg))
        return PreNormBlock(attention, self.gated_mlp(), norm=self.width_norm)
