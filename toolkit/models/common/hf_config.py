"""The ``config.json`` settings every rotary decoder class of transformers shares, read as ``DecoderOptions`` and
written back: sizes, rotary frequencies (``rope_theta``, ``rope_scaling`` / transformers 5's ``rope_parameters``),
the sliding window and which layers have it. A family's adapter (its ``hf.py``) adds its own settings.

What differs between the classes for these settings is data, a :class:`DecoderClass` per ``model_type``: whether
it has QK-norm or q/k/v biases, whether it reads ``sliding_window`` always (Mistral, Gemma 3) or only with
``use_sliding_window`` (Qwen), whether its layers may differ (``layer_types``), its head size when config.json
names none, whether its embeddings are tied when config.json does not say. Everything here works on plain dicts
read from the files (importing needs no transformers); anything the model would compute differently is refused
in one line naming the setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from toolkit.core.errors import UserError
from toolkit.models.common.options import LAYER_TYPES, DecoderOptions, head_dim, kv_heads, layer_windows
from toolkit.models.common.rope import yarn_attention_factor

REQUIRED = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "max_position_embeddings")
ROPE_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "linear": ("factor",),
}
HF_KEYS = {  # our option -> config.json's key of the shared settings: what a refusal of a value read names
    "decoder_layers": "num_hidden_layers",
    "decoder_embed_dim": "hidden_size",
    "decoder_ffn_embed_dim": "intermediate_size",
    "decoder_attention_heads": "num_attention_heads",
    "decoder_kv_heads": "num_key_value_heads",
    "decoder_head_dim": "head_dim",
    "max_target_positions": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "rope_scaling_factor": "rope_scaling.factor",
    "rope_original_max_positions": "rope_scaling.original_max_position_embeddings",
    "rope_low_freq_factor": "rope_scaling.low_freq_factor",
    "rope_high_freq_factor": "rope_scaling.high_freq_factor",
    "rope_yarn_beta_fast": "rope_scaling.beta_fast",
    "rope_yarn_beta_slow": "rope_scaling.beta_slow",
    "rope_attention_factor": "rope_scaling.attention_factor",
    "sliding_window": "sliding_window",
}


@dataclass(frozen=True)
class DecoderClass:
    """What one transformers class computes of the shared settings (see the module docstring)."""

    name: str  # the class, e.g. "LlamaForCausalLM"
    qk_norm: bool = False
    qkv_bias: bool = False
    window_always: bool = False  # sliding_window applies without use_sliding_window (Mistral, Gemma 3)
    layer_types: bool = False  # its layers may be local or global (Qwen2/Qwen3, Gemma 3)
    head_dim: Optional[int] = None  # when config.json has none (Qwen3's 128); else width / heads
    tied_by_default: bool = False  # tie_word_embeddings when config.json does not say (transformers' defaults)
    no_attention_bias: bool = False  # attention_bias is a key of its config, which the toolkit refuses set
    activation_key: str = "hidden_act"
    activation: str = "silu"  # the MLP's activation as config.json names it


def rope_keys(keys: Dict[str, str], config: Dict[str, Any]) -> Dict[str, str]:
    """``keys`` (our option -> config.json's key) as ``config`` spells the rotary settings: transformers 5 keeps
    them, the base included, in ``rope_parameters`` where older configs write ``rope_theta`` and ``rope_scaling``."""
    params = config.get("rope_parameters")
    if not isinstance(params, dict) or config.get("rope_scaling"):
        return dict(keys)
    out = {k: v.replace("rope_scaling.", "rope_parameters.") for k, v in keys.items()}
    if "rope_theta" in params:
        out["rope_theta"] = "rope_parameters.rope_theta"
    return out


def check_counts(config: Dict[str, Any], where: str) -> None:
    """The sizes present and positive integers (one line naming them otherwise)."""
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


def refuse_unsupported(config: Dict[str, Any], kind: DecoderClass, family: str, mlp: str, where: str) -> None:
    """The MLP's activation, biases and local layers the class has and ``family``'s model would not compute
    (``family`` as the message names it: "the Llama family"); ``mlp`` says what the family's MLP is."""
    activation = config.get(kind.activation_key, kind.activation)
    if activation != kind.activation:
        raise UserError(f"{where}: {kind.activation_key} {activation!r}; {mlp}")
    if config.get("mlp_bias") or (kind.no_attention_bias and config.get("attention_bias")):
        raise UserError(
            f"{where}: attention_bias/mlp_bias set; in {family} the toolkit has biases on q/k/v only (Qwen2)"
        )
    local = [t for t in config.get("layer_types") or () if t != "full_attention"]
    if local and not kind.layer_types:
        raise UserError(
            f"{where}: layer_types {sorted(set(local))} in a {kind.name}; its transformers class "
            "attends to the whole context (or Mistral's one window) in every layer"
        )


def rope_options(config: Dict[str, Any], where: str) -> Dict[str, Any]:
    """rope_theta and the llama3, yarn or linear scaling, from the legacy keys or transformers 5's
    ``rope_parameters``."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or params)
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out: Dict[str, Any] = {"rope_theta": float(theta), "rope_scaling_factor": None}
    if kind != "default" and kind not in ROPE_KEYS:
        *others, last = ROPE_KEYS
        raise UserError(
            f"{where}: rope_type {kind!r}; the toolkit computes the default, {', '.join(others)} and {last} "
            "rotary frequencies only"
        )
    if kind == "default":
        return out
    required = ROPE_KEYS[kind]
    missing = [k for k in required if scaling.get(k) is None]
    if missing:
        raise UserError(
            f"{where}: rope_scaling of rope_type {kind} has no {', '.join(missing)}; give all of "
            f"{', '.join(required)} (as the model's published config.json does)"
        )
    out.update(rope_scaling=kind, rope_scaling_factor=float(scaling["factor"]))
    if kind == "linear":
        return out
    out.update(rope_original_max_positions=int(scaling["original_max_position_embeddings"]))
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
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise UserError(f"{where}: rope_scaling truncate {truncate!r}: true or false (or no key: true)")
    factor = float(scaling["factor"])
    attention = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None and mscale and mscale_all_dim:
        attention = yarn_attention_factor(factor, mscale) / yarn_attention_factor(factor, mscale_all_dim)
    return dict(
        rope_yarn_beta_fast=float(scaling.get("beta_fast") or 32.0),
        rope_yarn_beta_slow=float(scaling.get("beta_slow") or 1.0),
        rope_attention_factor=None if attention is None else float(attention),
        rope_yarn_truncate=truncate,
    )


def sliding_window(config: Dict[str, Any], kind: DecoderClass, where: str) -> Optional[int]:
    """Mistral's window (Qwen2/Qwen3's with ``use_sliding_window``), None when there is none or it is no
    shorter than the context (it never binds)."""
    window = config.get("sliding_window") if kind.window_always or config.get("use_sliding_window") else None
    if window is not None and (type(window) is not int or window < 1):
        raise UserError(f"{where}: sliding_window {window!r}: a count of positions (a positive integer) or null")
    return window if window is not None and window < config["max_position_embeddings"] else None


def layer_types(config: Dict[str, Any], kind: DecoderClass, window: Optional[int], where: str) -> Optional[str]:
    """``--layer-types`` of a folder whose layers may differ, with a binding window: its ``layer_types``, else
    (configs saved before transformers wrote them) local from ``max_window_layers`` on; None when every layer
    is alike."""
    if not kind.layer_types or window is None:
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


def attention_options(config: Dict[str, Any], kind: DecoderClass, where: str) -> Dict[str, Any]:
    """Head size, QK-norm and the windows of each layer."""
    C, H = config["hidden_size"], config["num_attention_heads"]
    head_size = int(config.get("head_dim") or kind.head_dim or C // H)
    window = sliding_window(config, kind, where)
    local = layer_types(config, kind, window, where)
    if local is not None and "sliding_attention" not in local:
        window, local = None, None  # no layer is local
    return dict(
        decoder_head_dim=head_size if head_size != C // H or C % H else None,
        qk_norm=kind.qk_norm,
        sliding_window=window,
        layer_types=local,
    )


def shape_options(config: Dict[str, Any], kind: DecoderClass) -> Dict[str, Any]:
    """Sizes, norm epsilon, q/k/v biases, tied embeddings, context length."""
    return dict(
        decoder_layers=config["num_hidden_layers"],
        decoder_embed_dim=config["hidden_size"],
        decoder_ffn_embed_dim=config["intermediate_size"],
        decoder_attention_heads=config["num_attention_heads"],
        decoder_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        attention_qkv_bias=kind.qkv_bias,
        share_decoder_input_output_embed=bool(config.get("tie_word_embeddings", kind.tied_by_default)),
        max_target_positions=int(config["max_position_embeddings"]),
    )


# ---- --format hf -------------------------------------------------------------------------------------------


def decoder_hf_config(
    cfg: DecoderOptions,
    vocab_size: int,
    base: Optional[Dict[str, Any]],
    model_type: str,
    partial_rotary: bool = False,
) -> Dict:
    """The shared config.json values of ``cfg`` over ``base`` (the imported model's own config.json: its
    token ids, dtype and every setting we do not model stay). ``partial_rotary``: the class rotates part of each
    head (``partial_rotary_factor`` written); else a model that does is refused."""
    if cfg.partial_rotary_factor != 1 and not partial_rotary:
        raise UserError(
            f"--partial-rotary-factor {cfg.partial_rotary_factor}: the {model_type} class rotates whole heads; "
            "nothing written"
        )
    config = {k: v for k, v in (base or {}).items() if k not in ("rope_parameters", "rope_scaling", "architectures")}
    config.update(
        model_type=model_type,
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
    if partial_rotary:
        config["partial_rotary_factor"] = cfg.partial_rotary_factor
    if cfg.rope_scaling_factor is not None:
        config["rope_scaling"] = hf_rope_scaling(cfg)
    return config


def hf_rope_scaling(cfg: DecoderOptions) -> Dict[str, Any]:
    """``rope_scaling`` of ``--rope-scaling``; YaRN's attention factor written out (the default computed) so
    that transformers never falls back to a max_position_embeddings-derived factor."""
    if cfg.rope_scaling == "linear":
        return {"rope_type": "linear", "factor": cfg.rope_scaling_factor}
    common = {
        "rope_type": cfg.rope_scaling,
        "factor": cfg.rope_scaling_factor,
        "original_max_position_embeddings": cfg.rope_original_max_positions,
    }
    if cfg.rope_scaling == "llama3":
        return {**common, "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor}
    attention = cfg.rope_attention_factor
    yarn = {
        **common,
        "beta_fast": cfg.rope_yarn_beta_fast,
        "beta_slow": cfg.rope_yarn_beta_slow,
        "attention_factor": yarn_attention_factor(cfg.rope_scaling_factor) if attention is None else attention,
    }
    return yarn if cfg.rope_yarn_truncate else {**yarn, "truncate": False}


def layer_type_names(cfg: DecoderOptions) -> list:
    """Each layer's Hugging Face name: ``sliding_attention`` for a local layer, ``full_attention`` otherwise."""
    return ["full_attention" if w is None else "sliding_attention" for w in layer_windows(cfg)]


def qwen_windows(cfg: DecoderOptions) -> Dict[str, Any]:
    """Qwen2/Qwen3's window settings: ``layer_types`` decides (transformers 5); ``max_window_layers`` says the
    first local layer, for readers of older configs."""
    kinds = layer_type_names(cfg)
    first_local = kinds.index("sliding_attention") if "sliding_attention" in kinds else cfg.decoder_layers
    return dict(
        sliding_window=cfg.sliding_window,
        use_sliding_window=cfg.sliding_window is not None,
        max_window_layers=first_local,
        layer_types=kinds,
    )
