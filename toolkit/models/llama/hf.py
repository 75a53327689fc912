"""The Llama family's Hugging Face adapter: ``LlamaForCausalLM``, ``MistralForCausalLM`` (its ``sliding_window``:
every layer sees the last N positions), ``Qwen2ForCausalLM`` (q/k/v biases) and ``Qwen3ForCausalLM`` (QK-norm,
``head_dim`` independent of the width); Qwen2/Qwen3's ``use_sliding_window`` makes the layers its ``layer_types``
(or, older configs, those from ``max_window_layers`` on) local, ``--layer-types``.

Their parameters are ours under a prefix (``DECODER_KEYS``): ``model.`` before everything but the output layer,
``lm_head.weight`` for our ``output_projection.weight`` (absent when tied). Rotary embeddings are stored in the
same half-rotation layout, so no weight is permuted. The shared settings are read and written by
``common/hf_config.py``; anything our model would compute differently is refused in one line naming the setting.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from toolkit.core.errors import UserError
from toolkit.models.common import hf_config
from toolkit.models.common.hf_adapter import DecoderHFAdapter
from toolkit.models.common.hf_config import DecoderClass
from toolkit.models.common.options import DecoderOptions, layer_windows

KINDS = {
    "llama": DecoderClass("LlamaForCausalLM", no_attention_bias=True),
    "mistral": DecoderClass("MistralForCausalLM", window_always=True),
    "qwen2": DecoderClass("Qwen2ForCausalLM", qkv_bias=True, layer_types=True),
    "qwen3": DecoderClass("Qwen3ForCausalLM", qk_norm=True, layer_types=True, head_dim=128, no_attention_bias=True),
}


class LlamaAdapter(DecoderHFAdapter):
    FAMILY, FAMILY_NAME, MLP, KINDS = (
        "llama",
        "the Llama family",
        "the Llama family's feed-forward is SwiGLU (silu)",
        KINDS,
    )

    def hf_config(
        self, cfg: DecoderOptions, vocab_size: int, base: Optional[Dict[str, Any]] = None
    ) -> Tuple[str, Dict]:
        kind = self._kind(cfg, (base or {}).get("model_type"))
        config = hf_config.decoder_hf_config(cfg, vocab_size, base, kind)
        if kind in ("llama", "qwen3"):
            config.update(attention_bias=False)
        if kind == "llama":
            config.update(mlp_bias=False)
        elif kind == "mistral":
            config.update(sliding_window=cfg.sliding_window)
        else:
            config.update(hf_config.qwen_windows(cfg))
        return self.CLASSES[kind], config

    @staticmethod
    def _kind(cfg: DecoderOptions, base_kind: Optional[str]) -> str:
        """The imported model's own model_type when its class computes ``cfg``, else the one class that does:
        Qwen3 for QK-norm, Qwen2 for q/k/v biases (either with any window), Mistral for one window in every
        layer, Llama otherwise."""
        if cfg.mlp_activation != "silu":
            raise UserError(
                f"--mlp-activation {cfg.mlp_activation}: the Llama family's transformers classes compute SwiGLU "
                "(silu); nothing written"
            )
        local_and_global = len(set(layer_windows(cfg))) > 1
        needs = [kind for kind, used in (("qwen3", cfg.qk_norm), ("qwen2", cfg.attention_qkv_bias)) if used]
        if not needs and cfg.sliding_window is not None:
            needs = ["mistral"]
        if len(needs) > 1 or (needs == ["mistral"] and local_and_global):
            raise UserError(
                f"the model combines {' and '.join(KINDS[k].name for k in needs)} features "
                "(QK-norm, q/k/v biases, a sliding window in some layers only); no transformers class of the "
                "Llama family computes it, nothing written"
            )
        if needs:
            return needs[0]
        return base_kind if base_kind in ("llama", "mistral") else "llama"  # Qwen2/Qwen3 always have their features
