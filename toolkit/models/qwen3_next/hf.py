"""The Qwen3-Next family's Hugging Face adapter: ``Qwen3NextForCausalLM``, ``Qwen3_5MoeForCausalLM`` and
``Qwen3_5ForCausalLM`` folders (Qwen3.5's text models: ``model_type`` ``qwen3_5_moe_text`` / ``qwen3_5_text``) in
(``toolkit-export --from hf``) and out (``--format hf``).

The tensors are ours under ``model.`` (``KEYS``): a linear layer's token mixer is their ``linear_attn`` (ours
``self_attn``, as every layer's), the shared expert their ``mlp.shared_expert`` and its gate
``mlp.shared_expert_gate`` (ours ``mlp.shared_experts`` and ``mlp.shared_experts.expert_gate``); the experts one
matrix per expert under Qwen3-MoE's names, stacked into ours by the MoE family's adapter. The config's
``layer_types`` must be full attention every ``full_attention_interval``-th layer (the published pattern);
dense layers among experts (``mlp_only_layers``, ``decoder_sparse_step``) are refused in one line, as for
Qwen3-MoE. Qwen3.5's linear layers name their projections ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a`` (ours the same), its MoE router always renormalizes the top-k weights, and its dense class has a
SwiGLU MLP in every layer; its rotary tables are M-RoPE's, which for text (one position per token in all three
sections) are the plain ones.

Multi-token prediction: the releases hold one MTP layer under ``mtp.`` (transformers drops it on load; its config key
``mtp_num_hidden_layers``, vLLM's ``num_nextn_predict_layers``), our ``--mtp-depth 1`` (``common/mtp.py``):
``mtp.fc`` joins ``[pre_fc_norm_embedding(embedding); pre_fc_norm_hidden(hidden)]`` (our ``eh_proj``, ``enorm``,
``hnorm``), ``mtp.layers.0`` is a gated full-attention layer with the layers' MLP (our ``mtp.0.layer``, its tensors
named as a decoder layer's and converted as one: read as layer ``num_hidden_layers``), ``mtp.norm`` the norm before
the shared head (our ``mtp.0.norm``); every norm zero-centered as the decoder's. The count of depths is the folder's
``mtp.layers.{k}``; their ``fc`` and norms are one set shared by all the layers (vLLM's ``Qwen3NextMultiTokenPredictor``)
where ours are per depth, so a folder with more than one, or a model with more than one depth, is refused in one line.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Dict, Optional, Tuple

import torch

from toolkit.core.errors import UserError
from toolkit.models.common import hf_config
from toolkit.models.common.hf_adapter import DECODER_KEYS, KeyMap
from toolkit.models.common.hf_config import DecoderClass
from toolkit.models.common.hf_folder import tensor_names
from toolkit.models.deepseek_v3.hf import depth_blocks
from toolkit.models.moe.hf import MoEAdapter, _experts

KINDS = {
    kind: DecoderClass(name, qk_norm=True, layer_types=True, no_attention_bias=True)
    for kind, name in (
        ("qwen3_next", "Qwen3NextForCausalLM"),
        ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
        ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    )
}
SPLIT = ("qwen3_5_moe_text", "qwen3_5_text")  # the linear layers' projections split (Qwen3.5)
LINEAR_PARAMETERS = (
    "in_proj_qkvz.weight",
    "in_proj_ba.weight",
    "in_proj_qkv.weight",
    "in_proj_z.weight",
    "in_proj_b.weight",
    "in_proj_a.weight",
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
logger = logging.getLogger(__name__)
MTP_OWN = {  # theirs -> ours, the one depth's tensors beside its block
    "mtp.fc.weight": "mtp.0.eh_proj.weight",
    "mtp.pre_fc_norm_embedding.weight": "mtp.0.enorm.weight",
    "mtp.pre_fc_norm_hidden.weight": "mtp.0.hnorm.weight",
    "mtp.norm.weight": "mtp.0.norm.weight",
}
MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.")
MTP_COUNT_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")  # Qwen3.5's config key, vLLM's
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

    main_layers = 0  # num_hidden_layers: the MTP layer is read as the layer after them
    mtp_held = 0  # the MTP layers (mtp.layers.{k}) the folder read holds

    def key_map(self, model_type: str) -> KeyMap:
        return KEYS

    def read(self, folder: str, config: Dict[str, Any], out_dir: str, tokens_per_sample: Optional[int], advance):
        """The shared import; first, how many MTP layers the folder holds (one line when config.json names some that
        it does not hold; a refusal for more than one)."""
        self.mtp_held = len({int(m.group(1)) for m in map(MTP_LAYER.match, tensor_names(folder)) if m is not None})
        named = max(int(config.get(key) or 0) for key in MTP_COUNT_KEYS)
        if self.mtp_held > 1:
            raise UserError(
                f"{folder}: {self.mtp_held} MTP layers (mtp.layers.*) sharing one mtp.fc and its norms; the "
                "toolkit's depths each have their own (--mtp-depth), so it imports folders with one MTP layer"
            )
        if named and not self.mtp_held:
            logger.warning(
                f"{folder}: config.json names {named} MTP layer(s), but the folder holds no mtp.* tensor "
                "(transformers saves none): imported without multi-token prediction (--mtp-depth 0)"
            )
        return super().read(folder, config, out_dir, tokens_per_sample, advance)

    def put_from_hf(
        self, state: Dict[str, torch.Tensor], name: str, tensor: torch.Tensor, given: Dict[str, Any], keys: KeyMap
    ) -> None:
        """The MTP layer's own tensors under ``mtp.0.``, its block's as layer ``num_hidden_layers``'s
        (``state_from_hf`` moves them); any other tensor as the MoE family's (experts stacked)."""
        if not name.startswith("mtp."):
            return super().put_from_hf(state, name, tensor, given, keys)
        layer = MTP_LAYER.match(name)
        if name in MTP_OWN:
            state[MTP_OWN[name]] = tensor.float()
        elif layer is not None:
            block = f"model.layers.{given['decoder_layers'] + int(layer.group(1))}.{name[layer.end() :]}"
            super().put_from_hf(state, block, tensor, given, keys)
        else:
            raise UserError(
                f"{name}: an MTP tensor the toolkit's depth has no place for (it reads {', '.join(MTP_OWN)}"
            )

    def state_from_hf(self, tensors, given: Dict[str, Any], model_type: str) -> Dict[str, torch.Tensor]:
        """The shared conversion; the MTP layer's block tensors moved under ``mtp.0.layer.``."""
        return depth_blocks(super().state_from_hf(tensors, given, model_type), given["decoder_layers"])

    def write(self, model: Any, hf_class: str, dictionary: Any, first_symbol: int, data_dir: str):
        self.main_layers = model.cfg.decoder_layers
        return super().write(model, hf_class, dictionary, first_symbol, data_dir)

    def config_keys(self, config: Dict[str, Any]) -> Dict[str, str]:
        return hf_config.rope_keys(self.HF_KEYS, config)

    def options(self, config: Dict[str, Any], kind: str, where: str) -> Dict[str, Any]:
        """The shared attention, sizes and rotary settings, Qwen3-MoE's experts, then the shared expert, the
        rotated fraction of each head and the linear layers'."""
        traits = KINDS[kind]
        dense = kind == "qwen3_5_text"
        out = {
            **hf_config.attention_options(config, traits, where),
            **hf_config.shape_options(config, traits),
            **hf_config.rope_options(config, where),
            **({} if dense else _experts(config, "qwen3_moe", where)),
        }
        counts = LINEAR_KEYS if dense else (*LINEAR_KEYS, "shared_expert_intermediate_size")
        wrong = [f"{k} {config.get(k)!r}" for k in counts if type(config.get(k)) is not int or config[k] < 1]
        if wrong:
            raise UserError(f"{where}: {', '.join(wrong)}; these are counts (positive integers)")
        params = config.get("rope_parameters") or {}
        out.update({k: config[k] for k in LINEAR_KEYS})
        out.update(
            linear_split_projections=kind in SPLIT,
            dense_mlp=dense,
            moe_shared_ffn_embed_dim=0 if dense else config["shared_expert_intermediate_size"],
            partial_rotary_factor=float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))),
            full_attention_interval=_interval(config, where),
        )
        if kind == "qwen3_5_moe_text":
            out["moe_renormalize"] = True
        out["mtp_depth"], self.main_layers = self.mtp_held, config["num_hidden_layers"]
        return out

    def state_to_hf(self, state, model_type: str):
        """As the MoE family's with Qwen3-MoE's expert names (the same as Qwen3-Next's), renamed by ``KEYS``; the
        depth's block converted as the layer after the decoder's and named ``mtp.layers.0.``, its own tensors
        Qwen's ``mtp.`` names."""
        theirs_of = {ours: theirs for theirs, ours in MTP_OWN.items()}
        layers, own = {}, {}
        for name, tensor in state.items():
            if name in theirs_of:
                own[theirs_of[name]] = tensor
            elif name.startswith("mtp.0.layer."):
                layers[f"layers.{self.main_layers}.{name[len('mtp.0.layer.') :]}"] = tensor
            else:
                layers[name] = tensor
        block = f"model.layers.{self.main_layers}."
        out = {
            f"mtp.layers.0.{name[len(block) :]}" if name.startswith(block) else name: tensor
            for name, tensor in super().state_to_hf(layers, "qwen3_moe").items()
        }
        return {**out, **own}

    def hf_config(self, cfg, vocab_size: int, base: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
        """(Qwen3NextForCausalLM, config.json) computing ``cfg``, or a one-line refusal."""
        kind = _hf_kind(cfg)
        config = hf_config.decoder_hf_config(cfg, vocab_size, base, kind, partial_rotary=True)
        rope = config.pop("rope_scaling", None) or {"rope_type": "default"}
        rope.update(rope_theta=config.pop("rope_theta"), partial_rotary_factor=config.pop("partial_rotary_factor"))
        config.update(
            rope_parameters=rope,
            attention_bias=False,
            layer_types=_layer_type_names(cfg),
            **{k: getattr(cfg, k) for k in LINEAR_KEYS},
        )
        if not cfg.dense_mlp:
            config.update(
                num_experts=cfg.moe_num_experts,
                num_experts_per_tok=cfg.moe_top_k,
                moe_intermediate_size=cfg.moe_ffn_embed_dim,
                shared_expert_intermediate_size=cfg.moe_shared_ffn_embed_dim,
                router_aux_loss_coef=cfg.moe_aux_loss_coef,
            )
        if kind == "qwen3_next":
            config.update(norm_topk_prob=cfg.moe_renormalize, decoder_sparse_step=1, mlp_only_layers=[])
        config.update({key: cfg.mtp_depth for key in MTP_COUNT_KEYS if key in config})
        if cfg.mtp_depth:
            config["mtp_num_hidden_layers"] = cfg.mtp_depth
        return self.CLASSES[kind], config


def _hf_kind(cfg) -> str:
    """The class computing ``cfg`` (Qwen3-Next's fused projections, or Qwen3.5's MoE or dense), or a refusal."""
    if cfg.mtp_depth > 1:
        raise UserError(
            f"--format hf: --mtp-depth {cfg.mtp_depth}: Qwen's checkpoints hold one mtp.fc and its norms for all their "
            "MTP layers, the toolkit's depths one each; export a model of --mtp-depth 0 or 1, nothing written"
        )
    qwen3_5_moe = cfg.linear_split_projections and not cfg.dense_mlp
    if (
        cfg.moe_score_func != "softmax"
        or cfg.moe_bias_update_rate
        or not cfg.qk_norm
        or cfg.qk_norm_full_width
        or cfg.attention_qkv_bias
        or cfg.mlp_activation != "silu"
        or (cfg.dense_mlp and not cfg.linear_split_projections)
        or (qwen3_5_moe and not cfg.moe_renormalize)
    ):
        raise UserError(
            "--format hf: Qwen3NextForCausalLM and Qwen3.5's classes route by softmax without a routing bias (Qwen3.5 "
            "renormalizing the top-k), have QK-norm per head, no q/k/v biases and SwiGLU MLPs, and only Qwen3.5 "
            "(split projections) is dense; this model differs, nothing written"
        )
    if not cfg.linear_split_projections:
        return "qwen3_next"
    return "qwen3_5_text" if cfg.dense_mlp else "qwen3_5_moe_text"


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
