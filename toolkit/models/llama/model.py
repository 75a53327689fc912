"""The Llama decoder (Llama 2/3, Mistral, Qwen2, Qwen3, TinyLlama): ``common/rotary_decoder.py``'s model with
pre-norm blocks (``PreNormBlock``) of grouped-query attention and a gated MLP, RMSNorm everywhere.

Qwen3's QK-norm (``--qk-norm``, an RMSNorm per head of q and k, parameters ``q_norm`` / ``k_norm``) and
Mistral's sliding window (``--sliding-window``; ``--layer-types`` makes only some layers local, Qwen2/Qwen3's
``max_window_layers``) are options of the attention.
"""

from __future__ import annotations

from typing import Optional

from toolkit.core.registry import register_model
from toolkit.models.common.blocks import PreNormBlock
from toolkit.models.common.rotary_decoder import RotaryDecoderLM, decoder_attention
from toolkit.models.llama.config import LlamaConfig
from toolkit.models.llama.hf import LlamaAdapter
from toolkit.models.llama.parallel import tensor_parallel_plan


@register_model("llama", dataclass=LlamaConfig)
class LlamaLanguageModel(RotaryDecoderLM):
    """The decoder-only Llama / Mistral / Qwen2 / Qwen3 language model behind the toolkit's model interface."""

    HF_ADAPTER = LlamaAdapter
    PLAN = staticmethod(tensor_parallel_plan)
    supports_pipeline_parallel = True  # toolkit.distributed.pipeline composes its forward stage by stage

    def build_block(self, cfg: LlamaConfig, index: int, window: Optional[int]) -> PreNormBlock:
        return PreNormBlock(decoder_attention(cfg, window), self.gated_mlp(), norm=self.width_norm)
