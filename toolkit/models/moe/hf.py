"""Hugging Face adapters of the MoE family: ``Qwen3MoeForCausalLM``, ``OlmoeForCausalLM`` and
``MixtralForCausalLM`` folders in (``toolkit-export --from hf``) and out (``--format hf``).

The attention, norms, embeddings and rotary settings are read and written by the Llama family's adapters
(``llama/hf.py``: Qwen3-MoE's attention is Qwen3's, Mixtral's is Mistral's, OLMoE's is Llama's with
QK-norm over the whole projections); this module adds the experts. Each MoE layer's router is
``mlp.gate.weight`` in all three (Mixtral's prefix is ``block_sparse_moe``), its experts one matrix per
expert, ``experts.{e}.{gate,up,down}_proj.weight`` (Mixtral's ``w1``, ``w3``, ``w2``), which become our
stacked [E, F, C] / [E, C, F] tensors, filled one expert at a time as the tensors are read (so the
import holds one copy of the model), and are cut back into per-expert tensors on export. Router
settings: Qwen3-MoE renormalizes the top-k weights when ``norm_topk_prob``, OLMoE when its
``norm_topk_prob`` (default false), Mixtral always. What our model would compute differently (dense
``mlp_only_layers``, OLMoE's ``clip_qkv``) is refused in one line.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Optional, Tuple

import torch

from toolkit.core.errors import UserError
from toolkit.models.llama import hf as llama_hf

CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM", "mixtral": "MixtralForCausalLM"}
ATTENTION_OF = {"qwen3_moe": "qwen3", "olmoe": "llama", "mixtral": "mistral"}  # the Llama-family attention each has
MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
FAMILY = "moe"


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


def options_from_hf(config: Dict[str, Any], where: str) -> Dict[str, Any]:
    """Our ``MoEConfig`` values for a ``config.json``: the attention's through the Llama adapter, then the experts'."""
    kind = config.get("model_type")
    if kind not in CLASSES:
        raise UserError(f"{where}: model_type {kind!r}; the MoE family reads {', '.join(CLASSES.values())} folders")
    dense = dict(config, model_type=ATTENTION_OF[kind])
    if kind != "mixtral":  # Qwen3-MoE's and OLMoE's head size defaults to width / heads (Qwen3's to 128)
        dense["head_dim"] = config.get("head_dim") or config["hidden_size"] // max(1, config["num_attention_heads"])
    if "intermediate_size" not in dense and "moe_intermediate_size" in config:
        dense["intermediate_size"] = config["moe_intermediate_size"]
    given = llama_hf.options_from_hf(dense, where)
    given.update(_experts(config, kind, where))
    if kind == "olmoe":
        given["qk_norm"] = True
    return given


def state_from_hf(
    name: str, tensor: torch.Tensor, tied: bool, state: Dict[str, torch.Tensor], num_experts: int
) -> None:
    """Put one Hugging Face tensor into ``state`` (fp32): an expert's matrix into its row of the stacked tensor,
    anything else as the Llama family names it."""
    match = EXPERT.match(name)
    if match is not None:
        layer, expert, proj = int(match.group(1)), int(match.group(2)), match.group(3)
        key = f"layers.{layer}.mlp.experts.{MIXTRAL_NAMES.get(proj, proj)}"
        if key not in state:
            state[key] = torch.empty((num_experts,) + tuple(tensor.shape), dtype=torch.float32)
        state[key][expert].copy_(tensor)
        return
    converted = llama_hf.state_from_hf(name.replace(".block_sparse_moe.", ".mlp."), tensor, tied)
    if converted is not None:
        state[converted[0]] = converted[1]


def read_state(folder: str, given: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Our fp32 state dict, read tensor by tensor from the folder's safetensors files."""
    from toolkit.models.llama.hf_files import safetensors_tensors

    state: Dict[str, torch.Tensor] = {}
    for name, tensor in safetensors_tensors(folder):
        state_from_hf(name, tensor, given["share_decoder_input_output_embed"], state, given["moe_num_experts"])
    return state


def state_to_hf(state: Dict[str, torch.Tensor], kind: str) -> Dict[str, torch.Tensor]:
    """Hugging Face's tensors: each stacked expert tensor cut into its E matrices (Mixtral's names for Mixtral)."""
    out: Dict[str, torch.Tensor] = {}
    back = {ours: theirs for theirs, ours in MIXTRAL_NAMES.items()}
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    for name, tensor in llama_hf.state_to_hf(state).items():
        prefix, _, proj = name.rpartition(".mlp.experts.")
        if prefix:
            for e in range(tensor.size(0)):
                leaf = back[proj] if kind == "mixtral" else proj
                out[f"{prefix}.{block}.experts.{e}.{leaf}.weight"] = tensor[e]
        else:
            out[name.replace(".mlp.gate.", f".{block}.gate.")] = tensor
    return out


def hf_config(cfg, vocab_size: int, base: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
    """(class, config.json) computing ``cfg``: the imported class, else the one its router and attention need."""
    kind = _hf_kind(cfg, (base or {}).get("model_type"))
    dense_base = dict(base or {}, model_type=ATTENTION_OF[kind])
    _, config = llama_hf.hf_config(cfg, vocab_size, dense_base)
    for key in ("layer_types", "use_sliding_window", "mlp_bias") if kind != "qwen3_moe" else ("mlp_bias",):
        if key not in (base or {}):
            config.pop(key, None)
    config.update(model_type=kind, num_experts_per_tok=cfg.moe_top_k, router_aux_loss_coef=cfg.moe_aux_loss_coef)
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
    return CLASSES[kind], config


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
    if cfg.qk_norm and not cfg.qk_norm_full_width and cfg.attention_qkv_bias:
        can = []
    if not can:
        raise UserError(
            "--format hf: this combination of QK-norm, q/k/v biases and top-k renormalization is "
            "computed by none of Qwen3MoeForCausalLM, OlmoeForCausalLM, MixtralForCausalLM; nothing written"
        )
    return base_kind if base_kind in can else can[0]
