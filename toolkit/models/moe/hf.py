"""The MoE family's Hugging Face adapter: ``Qwen3MoeForCausalLM``, ``OlmoeForCausalLM`` and ``MixtralForCausalLM``
folders in (``toolkit-export --from hf``) and out (``--format hf``).

The attention, norms, embeddings and rotary settings are the shared ones (``common/hf_config.py``; Qwen3-MoE's
attention is Qwen3's, Mixtral's Mistral's, OLMoE's Llama's with QK-norm over the whole projections); this adapter
adds the experts. Each MoE layer's router is ``mlp.gate.weight`` (Mixtral's prefix ``block_sparse_moe``), its
experts one matrix per expert, ``experts.{e}.{gate,up,down}_proj.weight`` (Mixtral's ``w1``, ``w3``, ``w2``):
``EXPERT_NAMES`` as data. They become our stacked [E, F, C] / [E, C, F] tensors, filled one expert at a time as
the tensors are read (so the import holds one copy of the model; :meth:`MoEAdapter.put_from_hf`), and are cut
back into per-expert tensors on export (:meth:`MoEAdapter.state_to_hf`). Router settings: Qwen3-MoE renormalizes
the top-k weights when ``norm_topk_prob``, OLMoE when its ``norm_topk_prob`` (default false), Mixtral always.
What our model would compute differently (dense ``mlp_only_layers``, OLMoE's ``clip_qkv``) is refused in one
line.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from toolkit.core.errors import UserError
from toolkit.models.common import hf_config
from toolkit.models.common.hf_adapter import DECODER_KEYS, DecoderHFAdapter, KeyMap, template_pattern
from toolkit.models.common.hf_config import DecoderClass
from toolkit.models.common.moe import EXPERT_PROJECTIONS

KINDS = {
    "qwen3_moe": DecoderClass("Qwen3MoeForCausalLM", qk_norm=True, layer_types=True, no_attention_bias=True),
    "olmoe": DecoderClass("OlmoeForCausalLM", qk_norm=True, no_attention_bias=True),
    "mixtral": DecoderClass("MixtralForCausalLM", window_always=True),
}
OURS = "layers.{layer}.mlp.experts.{proj}"  # a stacked [E, ...] tensor of one layer's experts
EXPERT_NAMES = {  # model_type -> (their name of expert e's matrix, {our projection: theirs})
    "qwen3_moe": ("model.layers.{layer}.mlp.experts.{expert}.{proj}.weight", {p: p for p in EXPERT_PROJECTIONS}),
    "olmoe": ("model.layers.{layer}.mlp.experts.{expert}.{proj}.weight", {p: p for p in EXPERT_PROJECTIONS}),
    "mixtral": (
        "model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight",
        {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
    ),
}
EXPERTS_READ = [  # any class's expert names are read, whichever the folder's model_type
    (template_pattern(theirs), {v: k for k, v in names.items()}) for theirs, names in EXPERT_NAMES.values()
]
MIXTRAL_KEYS = KeyMap(
    rules=(("layers.{layer}.mlp.gate.weight", "model.layers.{layer}.block_sparse_moe.gate.weight"),)
    + DECODER_KEYS.rules,
    dropped=("{prefix}rotary_emb.inv_freq",),
)
WINDOW_KEYS = {  # the window settings each class's config.json is written with
    "qwen3_moe": ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types"),
    "olmoe": ("sliding_window", "max_window_layers"),
    "mixtral": ("sliding_window",),
}


class MoEAdapter(DecoderHFAdapter):
    FAMILY, FAMILY_NAME, MLP, KINDS = "moe", "the MoE family", "the MoE family's experts are SwiGLU (silu)", KINDS
    HF_KEYS = {
        **hf_config.HF_KEYS,
        "moe_num_experts": "num_experts",
        "moe_top_k": "num_experts_per_tok",
        "moe_ffn_embed_dim": "moe_intermediate_size",
        "moe_aux_loss_coef": "router_aux_loss_coef",
    }

    def key_map(self, model_type: str) -> KeyMap:
        return MIXTRAL_KEYS if model_type == "mixtral" else DECODER_KEYS

    def config_keys(self, config: Dict[str, Any]) -> Dict[str, str]:
        """Mixtral counts its experts in ``num_local_experts``; OLMoE and Mixtral give an expert's width as
        ``intermediate_size`` (Qwen3-MoE as ``moe_intermediate_size``)."""
        keys = super().config_keys(config)
        kind = config.get("model_type")
        if kind == "mixtral":
            keys["moe_num_experts"] = "num_local_experts"
        if kind != "qwen3_moe":
            keys["moe_ffn_embed_dim"] = "intermediate_size"
        return keys

    def complete(self, config: Dict[str, Any]) -> Dict[str, Any]:
        """Qwen3-MoE's width of the (unused) dense MLP may be missing: its experts' width stands in for the check."""
        if "intermediate_size" not in config and "moe_intermediate_size" in config:
            return dict(config, intermediate_size=config["moe_intermediate_size"])
        return config

    def options(self, config: Dict[str, Any], kind: str, where: str) -> Dict[str, Any]:
        """The attention's options (as the dense classes'), then the experts'."""
        return {**super().options(config, kind, where), **_experts(config, kind, where)}

    def put_from_hf(
        self, state: Dict[str, torch.Tensor], name: str, tensor: torch.Tensor, given: Dict[str, Any], keys: KeyMap
    ) -> None:
        """An expert's matrix into its row of our stacked tensor (fp32), any other tensor renamed by the key map."""
        for pattern, ours_of in EXPERTS_READ:
            m = pattern.fullmatch(name)
            if m is not None and m["proj"] in ours_of and m["expert"].isdigit():
                key = OURS.format(layer=m["layer"], proj=ours_of[m["proj"]])
                if key not in state:
                    state[key] = torch.empty((given["moe_num_experts"],) + tuple(tensor.shape), dtype=torch.float32)
                state[key][int(m["expert"])].copy_(tensor)
                return
        super().put_from_hf(state, name, tensor, given, keys)

    def state_to_hf(self, state: Dict[str, torch.Tensor], model_type: str) -> Dict[str, torch.Tensor]:
        """Their tensors: each stacked expert tensor cut into its E matrices, the rest renamed by the key map."""
        theirs, names = EXPERT_NAMES[model_type]
        stacked = template_pattern(OURS)
        out: Dict[str, torch.Tensor] = {}
        keys = self.key_map(model_type)
        for name, tensor in state.items():
            m = stacked.fullmatch(name)
            if m is None:
                out[keys.to_hf(name)] = tensor
                continue
            for e in range(tensor.size(0)):
                out[theirs.format(layer=m["layer"], expert=e, proj=names[m["proj"]])] = tensor[e]
        return out

    def hf_config(self, cfg, vocab_size: int, base: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
        """(class, config.json) computing ``cfg``: the imported class, else the one its router and attention need."""
        kind = _hf_kind(cfg, (base or {}).get("model_type"))
        config = hf_config.decoder_hf_config(cfg, vocab_size, base, kind)
        if kind != "mixtral":
            config.update(attention_bias=False)
        windows = hf_config.qwen_windows(cfg)
        config.update({k: v for k, v in windows.items() if k in WINDOW_KEYS[kind]})
        config.update(num_experts_per_tok=cfg.moe_top_k, router_aux_loss_coef=cfg.moe_aux_loss_coef)
        if kind == "qwen3_moe":
            config.update(
                num_experts=cfg.moe_num_experts,
                moe_intermediate_size=cfg.moe_ffn_embed_dim,
                norm_topk_prob=cfg.moe_renormalize,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
        elif kind == "olmoe":
            config.update(
                num_experts=cfg.moe_num_experts,
                intermediate_size=cfg.moe_ffn_embed_dim,
                norm_topk_prob=cfg.moe_renormalize,
                clip_qkv=None,
            )
        else:
            config.update(num_local_experts=cfg.moe_num_experts, intermediate_size=cfg.moe_ffn_embed_dim)
        return self.CLASSES[kind], config


def _experts(config: Dict[str, Any], kind: str, where: str) -> Dict[str, Any]:
    num = config.get("num_experts", config.get("num_local_experts"))
    k = config.get("num_experts_per_tok")
    width = config.get("moe_intermediate_size") if kind == "qwen3_moe" else config.get("intermediate_size")
    wrong = [
        f"{name} {v!r}"
        for name, v in (("num_experts", num), ("num_experts_per_tok", k), ("expert intermediate size", width))
        if type(v) is not int or v < 1
    ]
    if wrong:
        raise UserError(
            f"{where}: {', '.join(wrong)}; these are counts (positive integers), give the config.json "
            "transformers saved with the model"
        )
    if kind == "qwen3_moe" and (config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1):
        raise UserError(
            f"{where}: mlp_only_layers/decoder_sparse_step make some layers dense; the toolkit's MoE "
            "family puts experts in every layer (mlp_only_layers [] and decoder_sparse_step 1)"
        )
    if kind == "olmoe" and config.get("clip_qkv") is not None:
        raise UserError(
            f"{where}: clip_qkv {config['clip_qkv']}: the toolkit's OLMoE does not clip q/k/v; "
            "only models with clip_qkv null are read"
        )
    renormalize = True if kind == "mixtral" else bool(config.get("norm_topk_prob", False))
    return dict(
        moe_num_experts=num,
        moe_top_k=k,
        moe_ffn_embed_dim=width,
        moe_renormalize=renormalize,
        moe_score_func="softmax",
        moe_aux_loss_coef=float(config.get("router_aux_loss_coef", 0.01)),
        qk_norm_full_width=kind == "olmoe",
    )


def _hf_kind(cfg, base_kind: Optional[str]) -> str:
    """The transformers class that computes ``cfg`` (the imported one when it does), or a one-line refusal."""
    if cfg.moe_score_func != "softmax" or cfg.moe_shared_ffn_embed_dim or cfg.moe_bias_update_rate:
        raise UserError(
            "--format hf: sigmoid routing, shared experts and the routing bias have no Qwen3-MoE, OLMoE "
            "or Mixtral counterpart; nothing written"
        )
    if cfg.qk_norm and cfg.qk_norm_full_width:
        can = ["olmoe"]
    elif cfg.qk_norm:
        can = ["qwen3_moe"]
    else:
        can = ["mixtral"] if cfg.moe_renormalize else []
    if cfg.attention_qkv_bias or cfg.mlp_activation != "silu":
        can = []
    if not can:
        raise UserError(
            "--format hf: this combination of QK-norm, q/k/v biases, top-k renormalization and the experts' "
            "activation is computed by none of Qwen3MoeForCausalLM, OlmoeForCausalLM, MixtralForCausalLM; "
            "nothing written"
        )
    return base_kind if base_kind in can else can[0]
