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

The released Qwen3.5 folders are vision-language models (``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``: ``model_type`` ``qwen3_5`` / ``qwen3_5_moe``); their text model is read
(:func:`text_model`: the ``text_config``, the tensors under ``model.language_model.``, ``lm_head``), the vision
tower (``model.visual.``) left out with one log line, and ``--format hf`` writes that text model back as
``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``. Why text positions need no M-RoPE: transformers' text rotary
(``Qwen3_5TextRotaryEmbedding``) computes a table per position stream (temporal, height, width) and takes the
frequencies of each ``mrope_section`` from its stream; a text token has the same position in all three, so the
three tables are one and the result is ordinary RoPE over the rotated part of each head, for any section sizes,
interleaved or not.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Iterable, Iterator, Optional, Tuple

import torch

from toolkit.core.errors import UserError
from toolkit.models.common import hf_config
from toolkit.models.common.hf_adapter import DECODER_KEYS, KeyMap
from toolkit.models.common.hf_config import DecoderClass
from toolkit.models.common.hf_folder import tensor_names
from toolkit.models.moe.hf import MoEAdapter, _experts

logger = logging.getLogger(__name__)

KINDS = {
    kind: DecoderClass(name, qk_norm=True, layer_types=True, no_attention_bias=True)
    for kind, name in (
        ("qwen3_next", "Qwen3NextForCausalLM"),
        ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
        ("qwen3_5_text", "Qwen3_5ForCausalLM"),
        ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"),
        ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
    )
}
VISION_LANGUAGE = {"qwen3_5_moe": "qwen3_5_moe_text", "qwen3_5": "qwen3_5_text"}  # the released folder's -> its text
LANGUAGE, VISION, MTP = "model.language_model.", "model.visual.", "mtp."  # a vision-language folder's tensor names
TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
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

    text_prefix = "model."  # where the folder read holds the text model's tensors (a vision-language one: LANGUAGE)
    mtp_kept = False  # whether the model read has the folder's multi-token prediction layer (its --mtp-depth)

    def key_map(self, model_type: str) -> KeyMap:
        return KEYS

    def read(self, folder: str, config: Dict[str, Any], out_dir: str, tokens_per_sample: Optional[int], advance):
        """The shared import; of a vision-language folder, its text model (:func:`text_model`), with one log line
        saying what of the folder is left out."""
        if config.get("model_type") not in VISION_LANGUAGE:
            return super().read(folder, config, out_dir, tokens_per_sample, advance)
        self.text_prefix = LANGUAGE
        text = text_model(config, os.path.join(folder, "config.json"))
        imported = super().read(folder, text, out_dir, tokens_per_sample, advance)
        names = tensor_names(folder)
        vision, mtp = (sum(name.startswith(prefix) for name in names) for prefix in (VISION, MTP))
        imported.log = (
            f"{folder}: {KINDS[config['model_type']].name} imported as its text model ({KINDS[text['model_type']].name}"
            f", the class --format hf writes); left out the vision tower's {vision} tensors (model.visual.*)"
            + ("" if self.mtp_kept or not mtp else f" and the multi-token prediction layer's {mtp} (mtp.*)"),
        ) + tuple(imported.log)
        return imported

    def options_from_hf(self, config: Dict[str, Any], where: str) -> Dict[str, Any]:
        """The shared reading, of a vision-language folder's text model (:func:`text_model`)."""
        return super().options_from_hf(text_model(config, where), where)

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
        return out

    def state_from_hf(self, tensors, given: Dict[str, Any], model_type: str) -> Dict[str, torch.Tensor]:
        """The shared conversion, of a vision-language folder's text model (:func:`language_tensors`)."""
        self.mtp_kept = bool(given.get("mtp_depth"))
        if self.text_prefix == LANGUAGE:
            tensors = language_tensors(tensors, keep_mtp=self.mtp_kept)
        return super().state_from_hf(tensors, given, model_type)

    def state_to_hf(self, state, model_type: str):
        """As the MoE family's with Qwen3-MoE's expert names (the same as Qwen3-Next's), renamed by ``KEYS``; the
        text model's under ``model.language_model.`` where the folder read is a vision-language one."""
        out = super().state_to_hf(state, "qwen3_moe")
        if self.text_prefix != LANGUAGE:
            return out
        return {LANGUAGE + k[len("model.") :] if k.startswith("model.") else k: v for k, v in out.items()}

    def hf_config(self, cfg, vocab_size: int, base: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
        """(Qwen3NextForCausalLM, config.json) computing ``cfg``, or a one-line refusal; a model read from a
        vision-language folder as its text model's class (the section sizes of M-RoPE kept)."""
        kind = _hf_kind(cfg)
        if (base or {}).get("model_type") in VISION_LANGUAGE:
            logger.info(
                f"--format hf: the model read from a {KINDS[base['model_type']].name} folder is written as its text "
                f"model, {self.CLASSES[kind]} (no vision tower)"
            )
            base = text_model(base, "hf_config.json")
        config = hf_config.decoder_hf_config(cfg, vocab_size, base, kind, partial_rotary=True)
        rope = config.pop("rope_scaling", None) or {"rope_type": "default"}
        rope.update(rope_theta=config.pop("rope_theta"), partial_rotary_factor=config.pop("partial_rotary_factor"))
        rope.update({k: v for k, v in ((base or {}).get("rope_parameters") or {}).items() if k.startswith("mrope_")})
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
        return self.CLASSES[kind], config


def text_model(config: Dict[str, Any], where: str) -> Dict[str, Any]:
    """The config.json of a vision-language folder's text model (any other returned as it is): its
    ``text_config`` as the text class's (``model_type`` qwen3_5_text / qwen3_5_moe_text), the token ids of the top
    level where it has none, and the embeddings tied as transformers ties the vision-language class's: by the top
    level's ``tie_word_embeddings``, else the text_config's. An ``mrope_section`` that is not counts is refused in
    one line (transformers indexes its three sections)."""
    kind = config.get("model_type")
    if kind not in VISION_LANGUAGE:
        return config
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise UserError(
            f"{where}: model_type {kind!r} without a text_config object (the text model's settings); give the "
            "config.json saved with the model"
        )
    out = dict(text, model_type=VISION_LANGUAGE[kind])
    out.update({k: config[k] for k in TOKEN_KEYS if out.get(k) is None and config.get(k) is not None})
    tied = config.get("tie_word_embeddings")
    out["tie_word_embeddings"] = bool(text.get("tie_word_embeddings", False) if tied is None else tied)
    section = (out.get("rope_parameters") or {}).get("mrope_section")
    if section is not None and not (
        isinstance(section, list) and len(section) >= 3 and all(type(s) is int and s >= 0 for s in section)
    ):
        raise UserError(
            f"{where}: text_config.rope_parameters.mrope_section {section!r}: the rotary frequencies of the "
            "temporal, height and width positions, three counts (the releases' [11, 11, 10])"
        )
    return out


def language_tensors(tensors: Iterable[Tuple[str, torch.Tensor]], keep_mtp: bool) -> Iterator[Tuple[str, torch.Tensor]]:
    """A vision-language folder's (name, tensor) pairs as its text model's: ``model.language_model.x`` as
    ``model.x``, ``lm_head`` as it is, the vision tower's (``model.visual.``) left out, and the multi-token
    prediction layer's (``mtp.``) kept only where the model has one (``keep_mtp``)."""
    for name, tensor in tensors:
        if name.startswith(LANGUAGE):
            yield "model." + name[len(LANGUAGE) :], tensor
        elif not name.startswith(VISION) and (keep_mtp or not name.startswith(MTP)):
            yield name, tensor


def _hf_kind(cfg) -> str:
    """The class computing ``cfg`` (Qwen3-Next's fused projections, or Qwen3.5's MoE or dense), or a refusal."""
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
