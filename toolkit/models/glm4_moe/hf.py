"""The GLM-4.5 family's Hugging Face adapter: ``Glm4MoeForCausalLM`` folders (GLM-4.5, GLM-4.5-Air) in
(``toolkit-export --from hf``) and out (``--format hf``).

The attention is the shared grouped-query one (``common/hf_config.py``) with GLM's switches read from config.json:
``attention_bias`` (biases on q/k/v, not on o_proj), ``use_qk_norm`` (RMSNorm per head) and
``partial_rotary_factor`` (in ``rope_parameters`` or at the top level; transformers' default 0.5 where absent),
rotated as two halves of the rotary share, the layout the checkpoints hold (no rows to reorder). The router and
dense-layer settings are DeepSeek-V3's keys, read by that family's adapter; the tensor names are DeepSeek-V3's
(the correction bias ``e_score_correction_bias``), the experts one matrix per expert named as Qwen3-MoE's,
stacked into ours as the MoE family's adapter does. Multi-token prediction layers (those after
``num_hidden_layers``, ``num_nextn_predict_layers`` of them, which transformers skips) hold DeepSeek-V3's tensors
and are our ``--mtp-depth`` depths, in and out, by that family's adapter (``NextLayersAdapter``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from toolkit.core.errors import UserError
from toolkit.models.common import hf_config
from toolkit.models.common.hf_adapter import KeyMap
from toolkit.models.common.hf_config import DecoderClass
from toolkit.models.deepseek_v3.hf import KEYS, NextLayersAdapter
from toolkit.models.deepseek_v3.hf import _router as deepseek_router
from toolkit.models.deepseek_v3.hf import router_hf_config
from toolkit.models.moe.hf import MoEAdapter

KINDS = {"glm4_moe": DecoderClass("Glm4MoeForCausalLM")}
DEFAULT_PARTIAL_ROTARY = 0.5  # transformers' Glm4MoeConfig where config.json names none


class Glm4MoeAdapter(NextLayersAdapter, MoEAdapter):
    FAMILY, FAMILY_NAME = "glm4_moe", "the GLM-4.5 family"
    MLP, KINDS = "the GLM-4.5 family's MLP and experts are SwiGLU (silu)", KINDS
    HF_KEYS = {
        **MoEAdapter.HF_KEYS,
        "moe_num_experts": "n_routed_experts",
        "moe_ffn_embed_dim": "moe_intermediate_size",
        "partial_rotary_factor": "partial_rotary_factor",
    }

    def key_map(self, model_type: str) -> KeyMap:
        return KEYS

    def config_keys(self, config: Dict[str, Any]) -> Dict[str, str]:
        return hf_config.rope_keys(self.HF_KEYS, config)

    def options(self, config: Dict[str, Any], kind: str, where: str) -> Dict[str, Any]:
        """The shared sizes, attention and rotary settings with GLM's switches, then DeepSeekMoE's router and the
        dense first layers."""
        rope = config.get("rope_parameters") or {}
        partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY))
        return {
            **hf_config.attention_options(config, KINDS[kind], where),
            **hf_config.shape_options(config, KINDS[kind]),
            **hf_config.rope_options(config, where),
            **deepseek_router(config, where),
            "qk_norm": bool(config.get("use_qk_norm", False)),
            "attention_qkv_bias": bool(config.get("attention_bias", False)),
            "partial_rotary_factor": float(partial),
            **self.mtp_options(config),
        }

    def layers_to_hf(self, state: Dict[str, torch.Tensor], model_type: str) -> Dict[str, torch.Tensor]:
        """The MoE family's conversion with Qwen3-MoE's expert names, which are GLM's."""
        return super().layers_to_hf(state, "qwen3_moe")

    def hf_config(self, cfg, vocab_size: int, base: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
        """(Glm4MoeForCausalLM, config.json) computing ``cfg``, or a one-line refusal."""
        _refuse_other(cfg)
        config = hf_config.decoder_hf_config(cfg, vocab_size, base, "glm4_moe", partial_rotary=True)
        scaling = config.pop("rope_scaling", None) or {"rope_type": "default"}
        config.pop("partial_rotary_factor")
        config.pop("rope_theta")
        config.update(
            rope_parameters=dict(scaling, rope_theta=cfg.rope_theta, partial_rotary_factor=cfg.partial_rotary_factor),
            attention_bias=cfg.attention_qkv_bias,
            use_qk_norm=cfg.qk_norm,
            **router_hf_config(cfg),
            num_nextn_predict_layers=cfg.mtp_depth,
        )
        return self.CLASSES["glm4_moe"], config


def _refuse_other(cfg) -> None:
    if (
        cfg.moe_score_func != "sigmoid"
        or cfg.mlp_activation != "silu"
        or not cfg.moe_shared_ffn_embed_dim
        or cfg.moe_shared_ffn_embed_dim % cfg.moe_ffn_embed_dim
        or cfg.sliding_window is not None
        or cfg.layer_types is not None
        or cfg.qk_norm_full_width
    ):
        raise UserError(
            "--format hf: Glm4MoeForCausalLM routes by sigmoid scores, has SwiGLU experts, shared experts a whole "
            "(non-zero) number of experts wide, QK-norm per head and no window; this model differs, nothing written"
        )
