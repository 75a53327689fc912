"""The Gemma family's Hugging Face adapter: ``Gemma3ForCausalLM`` (text) folders, whose tensors are ours under
``model.`` (``DECODER_KEYS``; tied embeddings). Its own settings: the MLP's ``hidden_activation``
(``gelu_pytorch_tanh``), ``query_pre_attn_scalar``, ``final_logit_softcapping``, and the rotary frequencies per
layer type (transformers 5's ``rope_parameters`` with ``full_attention`` and ``sliding_attention``; before it,
``rope_theta`` with the local layers' ``rope_local_base_freq``); the local layers rotate unscaled, the global
ones may be scaled linearly (Gemma 3 4B's 128k context). ``Gemma3ForCausalLM`` computes no
``attn_logit_softcapping`` (QK-norm instead): it is read as none.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from toolkit.core.errors import UserError
from toolkit.models.common import hf_config
from toolkit.models.common.hf_adapter import DecoderHFAdapter
from toolkit.models.common.hf_config import DecoderClass
from toolkit.models.gemma3.config import Gemma3Config

KINDS = {
    "gemma3_text": DecoderClass(
        "Gemma3ForCausalLM",
        qk_norm=True,
        window_always=True,
        layer_types=True,
        tied_by_default=True,
        activation_key="hidden_activation",
        activation="gelu_pytorch_tanh",
    )
}


class Gemma3Adapter(DecoderHFAdapter):
    FAMILY, FAMILY_NAME, MLP, KINDS = "gemma3", "the Gemma family", "Gemma's MLP is GeGLU with gelu_pytorch_tanh", KINDS
    HF_KEYS = {
        **hf_config.HF_KEYS,
        "rope_local_theta": "rope_local_base_freq",
        "query_pre_attn_scalar": "query_pre_attn_scalar",
        "final_logit_softcap": "final_logit_softcapping",
    }

    def config_keys(self, config: Dict[str, Any]) -> Dict[str, str]:
        """transformers 5's ``rope_parameters`` hold one entry per layer type: the global layers' base and
        scaling under ``full_attention``, the local layers' base under ``sliding_attention``."""
        params = config.get("rope_parameters") or {}
        if "full_attention" not in params:
            return super().config_keys(config)
        keys = {k: v.replace("rope_scaling.", "rope_parameters.full_attention.") for k, v in self.HF_KEYS.items()}
        keys.update(
            rope_theta="rope_parameters.full_attention.rope_theta",
            rope_local_theta="rope_parameters.sliding_attention.rope_theta",
        )
        return keys

    def options(self, config: Dict[str, Any], kind: str, where: str) -> Dict[str, Any]:
        """The sizes and windows as every class's; the MLP, score scale, soft-caps and rotary bases Gemma's own."""
        return {
            **hf_config.attention_options(config, KINDS[kind], where),
            **hf_config.shape_options(config, KINDS[kind]),
            **_gemma_options(config, where),
        }

    def hf_config(self, cfg: Gemma3Config, vocab_size: int, base: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict]:
        _refuse_other_gemma(cfg)
        config = hf_config.decoder_hf_config(cfg, vocab_size, base, "gemma3_text")
        config.update(hf_config.qwen_windows(cfg))
        for key in ("rope_theta", "rope_scaling", "use_sliding_window"):
            config.pop(key, None)
        scalar = cfg.query_pre_attn_scalar
        full_attention = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if cfg.rope_scaling_factor is not None:
            full_attention = dict(hf_config.hf_rope_scaling(cfg), rope_theta=cfg.rope_theta)
        config.update(
            hidden_activation="gelu_pytorch_tanh",  # an int in Gemma3TextConfig when whole
            query_pre_attn_scalar=int(scalar) if scalar is not None and scalar == int(scalar) else scalar,
            attn_logit_softcapping=None,
            final_logit_softcapping=cfg.final_logit_softcap,
            rope_parameters={
                "full_attention": full_attention,
                "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta},
            },
        )
        return self.CLASSES["gemma3_text"], config


def _gemma_options(config: Dict[str, Any], where: str) -> Dict[str, Any]:
    """Gemma 3's own options: GeGLU, score scale, soft-caps and the rotary bases (``rope_parameters`` per layer
    type in transformers 5, ``rope_local_base_freq`` before)."""
    params = config.get("rope_parameters") or {}
    local = params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise UserError(
            f"{where}: rope_parameters.sliding_attention of rope_type {local['rope_type']!r}; the "
            "local layers rotate with the default frequencies only"
        )
    out = dict(
        mlp_activation="gelu_tanh",
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)),
        rope_local_theta=float(local.get("rope_theta", config.get("rope_local_base_freq", 10000.0))),
        attn_logit_softcap=None,  # Gemma3ForCausalLM applies no attn_logit_softcapping (QK-norm instead)
        final_logit_softcap=config.get("final_logit_softcapping"),
    )
    out.update(hf_config.rope_options(dict(config, rope_parameters=params.get("full_attention", params)), where))
    return out


def _refuse_other_gemma(cfg: Gemma3Config) -> None:
    if (
        (cfg.rope_scaling_factor is not None and cfg.rope_scaling != "linear")
        or cfg.attention_qkv_bias
        or not cfg.qk_norm
        or cfg.attn_logit_softcap is not None
        or cfg.mlp_activation != "gelu_tanh"
    ):
        raise UserError(
            "Gemma3ForCausalLM has QK-norm, GeGLU, no q/k/v biases, no RoPE scaling but a linear one and no "
            "soft-cap of the attention scores; this model differs, nothing written"
        )
