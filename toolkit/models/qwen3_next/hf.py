"""The Qwen3-Next family's Hugging Face adapter: ``Qwen3NextForCausalLM`` folders in (``toolkit-export --from hf``)
and out (``--format hf``).

The tensors are ours under ``model.`` (``KEYS``): a linear layer's token mixer is their ``linear_attn`` (ours
``self_attn``, as every layer's), the shared expert their ``mlp.shared_expert`` and its gate
``mlp.shared_expert_gate`` (ours ``mlp.shared_experts`` and ``mlp.shared_experts.expert_gate``); the experts one
matrix per expert under Qwen3-MoE's names, stacked into ours by the MoE family's adapter. The config's
``layer_types`` must be full attention every ``full_attention_interval``-th layer (the published pattern);
dense layers (``mlp_only_layers``, ``decoder_sparse_step``) are refused in one line, as for Qwen3-MoE.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from toolkit.core.errors import UserError
from toolkit.models.common import hf_config
from toolkit.models.common.hf_adapter import DECODER_KEYS, KeyMap
from toolkit.models.common.hf_config import DecoderClass
from toolkit.models.moe.hf import MoEAdapter, _experts

KINDS = {"qwen3_next": DecoderClass("Qwen3NextForCausalLM", qk_norm=True, layer_types=True, no_attention_bias=True)}
LINEAR_PARAMETERS = (
    "in_proj_qkvz.weight",
    "in_proj_ba.weight",
    "conv1d.weight",
    "dt_bias",
    "A_log",
    "norm.weight",
    "out_proj.weight",
)
KEYS = KeyMap(
    rules=tuple(
        (f"layers.{{layer}}.self_attn.{p}", f"model.layers.{{layer}}.linear_attn.{p}") for p in LINEAR_PARAMETERS
    )
    + (
        ("layers.{layer}.mlp.shared_experts.expert_gate.weight", "model.layers.{layer}.mlp.shared_expert_gate.weight"),
        ("layers.{layer}.mlp.shared_experts.{proj}", "model.layers.{layer}.mlp.shared_expert.{proj}"),
    )
    + DECODER_KEYS.rules,
    dropped=("{prefix}rotary_emb.inv_freq",),
)
LINEAR_KEYS = {  # our option -> config.json's key, the linear layers' (the same names)
    name: name
    for name in (
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
    )
}


class Qwen3NextAdapter(MoEAdapter):
    FAMILY, FAMILY_NAME = "qwen3_next", "the Qwen3-Next family"
    MLP, KINDS = "the Qwen3-Next family's experts are SwiGLU (silu)", KINDS
    HF_KEYS = {
        **MoEAdapter.HF_KEYS,
        **LINEAR_KEYS,
        "moe_ffn_embed_dim": "moe_intermediate_size",
        "moe_shared_ffn_embed_dim": "shared_expert_intermediate_size",
    }

    def key_map(self, model_type: str) -> KeyMap:
        return KEYS

    def config_keys(self, config: Dict[str, Any]) -> Dict[str, str]:
        return hf_config.rope_keys(self.HF_KEYS, config)

    def options(self, config: Dict[str, Any], kind: str, where: str) -> Dict[str, Any]:
        """The shared attention, sizes and rotary settings, Qwen3-MoE's experts, then the shared expert, the
        rotated fraction of each head and the linear layers'."""
        traits = KINDS[kind]
        out = {
            **hf_config.attention_options(config, traits, where),
            **hf_config.shape_options(config, traits),
            **hf_config.rope_options(config, where),
            **_experts(config, "qwen3_moe", where),
        }
        wrong = [
            f"{k} {config.get(k)!r}"
            for k in (*LINEAR_KEYS, "shared_expert_intermediate_size")
            if type(config.get(k)) is not int or config[k] < 1
        ]
        if wrong:
            raise UserError(f"{where}: {', '.join(wrong)}; these are counts (positive integers)")
        params = config.get("rope_parameters") or {}
        out.update({k: config[k] for k in LINEAR_KEYS})
        out.update(
            moe_shared_ffn_embed_dim=config["shared_expert_intermediate_size"],
            partial_rotary_factor=float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))),
            full_attention_interval=_interval(config, where),
        )
        return out

    def state_to_hf(self, state, model_type: str):
        """As the MoE family's with Qwen3-MoE's expert names (the same as Qwen3-Next's), renamed by ``KEYS``."""
        return super().state_to_hf(state, "qwen3_moe")

    def hf_config(self, cfg, vocab_size: int, base: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
        """(Qwen3NextForCausalLM, config.json) computing ``cfg``, or a one-line refusal."""
        if (
            cfg.moe_score_func != "softmax"
            or cfg.moe_bias_update_rate
            or not cfg.qk_norm
            or cfg.qk_norm_full_width
            or cfg.attention_qkv_bias
            or cfg.mlp_activation != "silu"
        ):
            raise UserError(
                "--format hf: Qwen3NextForCausalLM routes by softmax without a routing bias, has QK-norm per head, "
                "no q/k/v biases and SwiGLU experts; this model differs, nothing written"
            )
        config = hf_config.decoder_hf_config(cfg, vocab_size, base, "qwen3_next", partial_rotary=True)
        rope = config.pop("rope_scaling", None) or {"rope_type": "default"}
        rope.update(rope_theta=config.pop("rope_theta"), partial_rotary_factor=config.pop("partial_rotary_factor"))
        config.update(
            rope_parameters=rope,
            attention_bias=False,
            layer_types=_layer_type_names(cfg),
            num_experts=cfg.moe_num_experts,
            num_experts_per_tok=cfg.moe_top_k,
            moe_intermediate_size=cfg.moe_ffn_embed_dim,
            shared_expert_intermediate_size=cfg.moe_shared_ffn_embed_dim,
            norm_topk_prob=cfg.moe_renormalize,
            router_aux_loss_coef=cfg.moe_aux_loss_coef,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **{k: getattr(cfg, k) for k in LINEAR_KEYS},
        )
        return self.CLASSES["qwen3_next"], config


def _layer_type_names(cfg) -> list:
    return [
        "full_attention" if (i + 1) % cfg.full_attention_interval == 0 else "linear_attention"
        for i in range(cfg.decoder_layers)
    ]


def _interval(config: Dict[str, Any], where: str) -> int:
    """``full_attention_interval`` of a config, checked against its ``layer_types`` (one line when they are
    another pattern)."""
    L = config["num_hidden_layers"]
    kinds = config.get("layer_types")
    if not kinds:
        interval = config.get("full_attention_interval", 4)
        return interval if type(interval) is int and interval >= 1 else 4
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    interval = full[0] + 1 if full else L + 1
    expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(L)]
    if list(kinds) != expected:
        raise UserError(
            f"{where}: layer_types {kinds!r}: the toolkit's Qwen3-Next has full attention every N-th layer and "
            "gated DeltaNet in the others (full_attention_interval); this pattern differs"
        )
    return interval
