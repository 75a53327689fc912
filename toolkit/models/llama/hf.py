"""Hugging Face adapters of the Llama family: ``config.json`` <-> options, state dicts both ways.

Classes: ``LlamaForCausalLM``, ``MistralForCausalLM`` (its ``sliding_window``: every layer sees the
last N positions), ``Qwen2ForCausalLM`` (q/k/v biases) and ``Qwen3ForCausalLM`` (QK-norm, ``head_dim``
independent of the width), ``Olmo2ForCausalLM`` (norms after attention and the MLP, QK-norm over the
whole projections), ``Gemma3ForCausalLM`` (text: its norms, GeGLU, score scale, local/global layers
with their own rotary bases, final logit soft-cap; it computes no ``attn_logit_softcapping``); Qwen2/Qwen3's ``use_sliding_window`` makes the layers its ``layer_types``
(or, older configs, those from ``max_window_layers`` on) local, ``--layer-types``. Their parameters are ours under a prefix:
``model.`` before everything but the output layer, ``lm_head.weight`` for our
``output_projection.weight`` (absent when tied). Rotary embeddings are stored in the same
half-rotation layout, so no weight is permuted. Everything here works on plain dicts read from
the files, so importing needs no transformers; anything our model would compute differently is
refused in one line naming the setting.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from toolkit.core.errors import UserError, malformed_file
from toolkit.models.blocks.rope import yarn_attention_factor
from toolkit.models.llama.config import LAYER_TYPES, LlamaConfig, head_dim, kv_heads, layer_windows

CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
TIED_BY_DEFAULT = {
    "llama": False,
    "mistral": False,
    "qwen2": False,
    "qwen3": False,  # transformers' config defaults
    "olmo2": False,
    "gemma3_text": True,
}
QWEN = ("qwen2", "qwen3", "gemma3_text")  # the classes whose layers may differ (layer_types)
DEFAULT_HEAD_DIM = {"qwen3": 128}  # Qwen3Config's head_dim when config.json has none (others: width / heads)
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
YARN_ROPE_KEYS = ("factor", "original_max_position_embeddings")
REQUIRED = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "max_position_embeddings")


def _rope(config: Dict[str, Any], where: str) -> Dict[str, Any]:
    """rope_theta and the llama3 or yarn scaling, from the legacy keys or transformers 5's ``rope_parameters``."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or params)
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out: Dict[str, Any] = {"rope_theta": float(theta), "rope_scaling_factor": None}
    if kind not in ("default", "llama3", "yarn"):
        raise UserError(
            f"{where}: rope_type {kind!r}; the toolkit computes the default, llama3 and yarn rotary frequencies only"
        )
    if kind == "default":
        return out
    required = LLAMA3_ROPE_KEYS if kind == "llama3" else YARN_ROPE_KEYS
    missing = [k for k in required if scaling.get(k) is None]
    if missing:
        raise UserError(
            f"{where}: rope_scaling of rope_type {kind} has no {', '.join(missing)}; give all of "
            f"{', '.join(required)} (as the model's published config.json does)"
        )
    out.update(
        rope_scaling=kind,
        rope_scaling_factor=float(scaling["factor"]),
        rope_original_max_positions=int(scaling["original_max_position_embeddings"]),
    )
    if kind == "llama3":
        out.update(
            rope_low_freq_factor=float(scaling["low_freq_factor"]),
            rope_high_freq_factor=float(scaling["high_freq_factor"]),
        )
    else:
        out.update(_yarn(scaling, where))
    return out


def _yarn(scaling: Dict[str, Any], where: str) -> Dict[str, Any]:
    """YaRN's ramp and attention factor as transformers' ``_compute_yarn_parameters`` reads them: null betas
    are 32 and 1; DeepSeek's mscale/mscale_all_dim give the attention factor when it is not written."""
    if scaling.get("truncate", True) is not True:
        raise UserError(
            f"{where}: rope_scaling truncate {scaling['truncate']!r}; the toolkit rounds YaRN's "
            "correction range outwards (truncate true, transformers' default); drop the key"
        )
    factor = float(scaling["factor"])
    attention = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None and mscale and mscale_all_dim:
        attention = yarn_attention_factor(factor, mscale) / yarn_attention_factor(factor, mscale_all_dim)
    return dict(
        rope_yarn_beta_fast=float(scaling.get("beta_fast") or 32.0),
        rope_yarn_beta_slow=float(scaling.get("beta_slow") or 1.0),
        rope_attention_factor=None if attention is None else float(attention),
    )


def _gemma3(config: Dict[str, Any], where: str) -> Dict[str, Any]:
    """Gemma 3's own options: its norms, GeGLU, score scale, soft-caps and the local layers' rotary base
    (``rope_parameters`` per layer type in transformers 5, ``rope_local_base_freq`` before)."""
    if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise UserError(
            f"{where}: hidden_activation {config['hidden_activation']!r}; Gemma's MLP is GeGLU with gelu_pytorch_tanh"
        )
    params = config.get("rope_parameters") or {}
    local = params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise UserError(
            f"{where}: rope_parameters.sliding_attention of rope_type {local['rope_type']!r}; the "
            "local layers rotate with the default frequencies only"
        )
    out = dict(
        gemma_norms=True,
        mlp_activation="gelu_tanh",
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)),
        rope_local_theta=float(local.get("rope_theta", config.get("rope_local_base_freq", 10000.0))),
        attn_logit_softcap=None,  # Gemma3ForCausalLM applies no attn_logit_softcapping (QK-norm instead)
        final_logit_softcap=config.get("final_logit_softcapping"),
    )
    out.update(_rope(dict(config, rope_parameters=params.get("full_attention", params)), where))
    return out


def _refuse_unsupported(config: Dict[str, Any], kind: str, where: str) -> None:
    if kind != "gemma3_text" and config.get("hidden_act", "silu") != "silu":
        raise UserError(
            f"{where}: hidden_act {config['hidden_act']!r}; the Llama family's feed-forward is SwiGLU (silu)"
        )
    if config.get("mlp_bias") or (kind in ("llama", "qwen3", "olmo2") and config.get("attention_bias")):
        raise UserError(f"{where}: attention_bias/mlp_bias set; the toolkit's Llama has biases on q/k/v only (Qwen2)")
    local = [t for t in config.get("layer_types") or () if t != "full_attention"]
    if local and kind not in QWEN:
        raise UserError(
            f"{where}: layer_types {sorted(set(local))} in a {CLASSES[kind]}; its transformers class "
            "attends to the whole context (or Mistral's one window) in every layer"
        )


def _sliding_window(config: Dict[str, Any], kind: str, where: str) -> Optional[int]:
    """Mistral's window (Qwen2/Qwen3's with ``use_sliding_window``), None when there is none or it is no
    shorter than the context (it never binds)."""
    window = (
        config.get("sliding_window") if kind in ("mistral", "gemma3_text") or config.get("use_sliding_window") else None
    )
    if window is not None and (type(window) is not int or window < 1):
        raise UserError(f"{where}: sliding_window {window!r}: a count of positions (a positive integer) or null")
    return window if window is not None and window < config["max_position_embeddings"] else None


def _layer_types(config: Dict[str, Any], kind: str, window: Optional[int], where: str) -> Optional[str]:
    """``--layer-types`` of a Qwen2/Qwen3 folder with a binding window: its ``layer_types``, else (configs
    saved before transformers wrote them) local from ``max_window_layers`` on; None when every layer is alike."""
    if kind not in QWEN or window is None:
        return None
    L = config["num_hidden_layers"]
    kinds = config.get("layer_types") or [
        "sliding_attention" if i >= config.get("max_window_layers", L) else "full_attention" for i in range(L)
    ]
    if len(kinds) != L or set(kinds) - set(LAYER_TYPES):
        raise UserError(
            f"{where}: layer_types {kinds!r}: one of {' or '.join(LAYER_TYPES)} for each of the "
            f"{L} layers (num_hidden_layers)"
        )
    return None if set(kinds) == {"sliding_attention"} else ",".join(kinds)


def options_from_hf(config: Dict[str, Any], where: str) -> Dict[str, Any]:
    """Our ``LlamaConfig`` values for a ``config.json`` (a dict), or a one-line refusal."""
    kind = config.get("model_type")
    if kind not in CLASSES:
        raise UserError(
            f"{where}: model_type {kind!r}; the Llama family reads {', '.join(CLASSES.values())} "
            "folders (toolkit-export --from hf picks the family by model_type)"
        )
    missing = [k for k in REQUIRED if k not in config]
    if missing:
        raise UserError(f"{where}: no {', '.join(missing)}; give the config.json transformers saved with the model")
    counts = REQUIRED + (("num_key_value_heads",) if config.get("num_key_value_heads") is not None else ())
    wrong = [f"{k} {config[k]!r}" for k in counts if type(config[k]) is not int or config[k] < 1]
    if wrong:
        raise UserError(
            f"{where}: {', '.join(wrong)}; these are counts (positive integers), give the config.json "
            "transformers saved with the model"
        )
    with malformed_file(where, "give the config.json transformers saved with the model"):  # e.g. a str for a float
        _refuse_unsupported(config, kind, where)
        return _options(config, kind, where)


def _options(config: Dict[str, Any], kind: str, where: str) -> Dict[str, Any]:
    C, H = config["hidden_size"], config["num_attention_heads"]
    head_size = int(config.get("head_dim") or DEFAULT_HEAD_DIM.get(kind, C // H))
    window = _sliding_window(config, kind, where)
    layer_types = _layer_types(config, kind, window, where)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window, layer_types = None, None  # no layer is local
    return dict(
        decoder_head_dim=head_size if head_size != C // H or C % H else None,
        qk_norm=kind in ("qwen3", "olmo2", "gemma3_text"),
        qk_norm_over="projection" if kind == "olmo2" else "head",
        norm_after_sublayer=kind == "olmo2",
        sliding_window=window,
        layer_types=layer_types,
        decoder_layers=config["num_hidden_layers"],
        decoder_embed_dim=config["hidden_size"],
        decoder_ffn_embed_dim=config["intermediate_size"],
        decoder_attention_heads=config["num_attention_heads"],
        decoder_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        attention_qkv_bias=kind == "qwen2",
        share_decoder_input_output_embed=bool(config.get("tie_word_embeddings", TIED_BY_DEFAULT[kind])),
        max_target_positions=int(config["max_position_embeddings"]),
        **(_gemma3(config, where) if kind == "gemma3_text" else _rope(config, where)),
    )


def state_from_hf(name: str, tensor: torch.Tensor, tied: bool) -> Optional[Tuple[str, torch.Tensor]]:
    """(our name, fp32 tensor) of one Hugging Face tensor; None for what we do not keep."""
    if name == "lm_head.weight":
        return None if tied else ("output_projection.weight", tensor.float())
    if name.endswith("rotary_emb.inv_freq") or not name.startswith("model."):
        return None  # computed buffers of older transformers
    return name[len("model.") :], tensor.float()


def state_to_hf(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {
        ("lm_head.weight" if name == "output_projection.weight" else f"model.{name}"): tensor
        for name, tensor in state.items()
    }


def hf_config(cfg: LlamaConfig, vocab_size: int, base: Optional[Dict[str, Any]] = None) -> Tuple[str, Dict[str, Any]]:
    """(class name, config.json values) computing exactly ``cfg``. ``base`` (the imported model's own
    config.json) keeps its class and every setting we do not model (token ids, dtype, ...)."""
    kind = _hf_kind(cfg, (base or {}).get("model_type"))
    config = {k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "rope_scaling", "architectures")}
    config.update(
        model_type=kind,
        hidden_size=cfg.decoder_embed_dim,
        intermediate_size=cfg.decoder_ffn_embed_dim,
        num_hidden_layers=cfg.decoder_layers,
        num_attention_heads=cfg.decoder_attention_heads,
        num_key_value_heads=kv_heads(cfg),
        head_dim=head_dim(cfg),
        hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        vocab_size=vocab_size,
        max_position_embeddings=cfg.max_target_positions,
        tie_word_embeddings=cfg.share_decoder_input_output_embed,
        attention_dropout=0.0,
    )
    if kind in ("llama", "qwen3", "olmo2"):
        config.update(attention_bias=False)
    if kind == "llama":
        config.update(mlp_bias=False)
    elif kind == "mistral":
        config.update(sliding_window=cfg.sliding_window)
    elif kind in QWEN:
        config.update(_qwen_windows(cfg))
    if kind == "gemma3_text":
        config.pop("rope_theta", None)
        scalar = cfg.query_pre_attn_scalar
        config.update(
            hidden_activation="gelu_pytorch_tanh",  # an int in Gemma3TextConfig when whole
            query_pre_attn_scalar=int(scalar) if scalar is not None and scalar == int(scalar) else scalar,
            attn_logit_softcapping=None,
            final_logit_softcapping=cfg.final_logit_softcap,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_theta or cfg.rope_theta},
            },
        )
        config.pop("use_sliding_window", None)
    if cfg.rope_scaling_factor is not None:
        config["rope_scaling"] = _hf_rope_scaling(cfg)
    return CLASSES[kind], config


def _hf_rope_scaling(cfg: LlamaConfig) -> Dict[str, Any]:
    """``rope_scaling`` of ``--rope-scaling``; YaRN's attention factor written out (the default computed) so
    that transformers never falls back to a max_position_embeddings-derived factor."""
    common = {
        "rope_type": cfg.rope_scaling,
        "factor": cfg.rope_scaling_factor,
        "original_max_position_embeddings": cfg.rope_original_max_positions,
    }
    if cfg.rope_scaling == "llama3":
        return {**common, "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor}
    attention = cfg.rope_attention_factor
    return {
        **common,
        "beta_fast": cfg.rope_yarn_beta_fast,
        "beta_slow": cfg.rope_yarn_beta_slow,
        "attention_factor": yarn_attention_factor(cfg.rope_scaling_factor) if attention is None else attention,
    }


def _qwen_windows(cfg: LlamaConfig) -> Dict[str, Any]:
    """Qwen2/Qwen3's window settings: ``layer_types`` decides (transformers 5); ``max_window_layers`` says the
    first local layer, for readers of older configs."""
    windows = layer_windows(cfg)
    kinds = ["full_attention" if w is None else "sliding_attention" for w in windows]
    first_local = kinds.index("sliding_attention") if "sliding_attention" in kinds else cfg.decoder_layers
    return dict(
        sliding_window=cfg.sliding_window,
        use_sliding_window=cfg.sliding_window is not None,
        max_window_layers=first_local,
        layer_types=kinds,
    )


def _hf_kind(cfg: LlamaConfig, base_kind: Optional[str]) -> str:
    """The imported model's own model_type when its class computes ``cfg``, else the one class that does:
    Qwen3 for QK-norm, Qwen2 for q/k/v biases (either with any window), Mistral for one window in every
    layer, Llama otherwise."""
    if cfg.gemma_norms:
        if (
            cfg.rope_scaling_factor is not None
            or cfg.attention_qkv_bias
            or not cfg.qk_norm
            or cfg.attn_logit_softcap is not None
        ):
            raise UserError(
                "Gemma3ForCausalLM has QK-norm, no q/k/v biases, no Llama 3 RoPE scaling and no "
                "soft-cap of the attention scores; this model differs, nothing written"
            )
        return "gemma3_text"
    olmo2 = cfg.norm_after_sublayer or (cfg.qk_norm and cfg.qk_norm_over == "projection")
    if olmo2:
        if not (
            cfg.norm_after_sublayer
            and cfg.qk_norm
            and cfg.qk_norm_over == "projection"
            and not cfg.attention_qkv_bias
            and cfg.sliding_window is None
        ):
            raise UserError(
                "Olmo2ForCausalLM has --norm-after-sublayer and --qk-norm --qk-norm-over projection "
                "together, no q/k/v biases and no window; this model differs, no transformers class of "
                "the Llama family computes it, nothing written"
            )
        return "olmo2"
    local_and_global = len(set(layer_windows(cfg))) > 1
    needs = [kind for kind, used in (("qwen3", cfg.qk_norm), ("qwen2", cfg.attention_qkv_bias)) if used]
    if not needs and cfg.sliding_window is not None:
        needs = ["mistral"]
    if len(needs) > 1 or (needs == ["mistral"] and local_and_global):
        raise UserError(
            f"the model combines {' and '.join(CLASSES[k] for k in needs)} features "
            "(QK-norm, q/k/v biases, a sliding window in some layers only); no transformers class of the "
            "Llama family computes it, nothing written"
        )
    if needs:
        return needs[0]
    return base_kind if base_kind in ("llama", "mistral") else "llama"  # Qwen2/Qwen3 always have their features
