"""The OLMo 2 family's Hugging Face adapter: ``Olmo2ForCausalLM`` folders, whose tensors are ours under ``model.``
(``DECODER_KEYS``): norms after attention and the MLP, QK-norm over the whole projections (``q_norm`` of H x D)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from toolkit.core.errors import UserError
from toolkit.models.common import hf_config
from toolkit.models.common.hf_adapter import DecoderHFAdapter
from toolkit.models.common.hf_config import DecoderClass
from toolkit.models.olmo2.config import Olmo2Config

KINDS = {"olmo2": DecoderClass("Olmo2ForCausalLM", qk_norm=True, no_attention_bias=True)}


class Olmo2Adapter(DecoderHFAdapter):
    FAMILY, FAMILY_NAME, MLP, KINDS = (
        "olmo2",
        "the OLMo 2 family",
        "the OLMo 2 family's feed-forward is SwiGLU (silu)",
        KINDS,
    )

    def options(self, config: Dict[str, Any], kind: str, where: str) -> Dict[str, Any]:
        """Every class's options, its QK-norm over the whole projections."""
        shared = super().options(config, kind, where)
        head_size, qk_norm = shared.pop("decoder_head_dim"), shared.pop("qk_norm")
        return {"decoder_head_dim": head_size, "qk_norm": qk_norm, "qk_norm_over": "projection", **shared}

    def hf_config(self, cfg: Olmo2Config, vocab_size: int, base: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict]:
        if not (
            cfg.qk_norm
            and cfg.qk_norm_over == "projection"
            and not cfg.attention_qkv_bias
            and cfg.sliding_window is None
            and cfg.mlp_activation == "silu"
        ):
            raise UserError(
                "Olmo2ForCausalLM has --qk-norm --qk-norm-over projection, SwiGLU, no q/k/v biases and no "
                "window; this model differs, no transformers class of the OLMo 2 family computes it, nothing written"
            )
        config = hf_config.decoder_hf_config(cfg, vocab_size, base, "olmo2")
        config.update(attention_bias=False)
        return self.CLASSES["olmo2"], config
