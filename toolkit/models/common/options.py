"""Options every rotary decoder family shares (``llama``, ``gemma3``, ``olmo2``, ``moe``), and what follows from them.

A family's options dataclass inherits :class:`DecoderOptions` and adds its own fields, so one flag (e.g.
``--rope-theta``) means the same in every family. Fields that fairseq's ``transformer_lm`` also declares keep its
names (``--decoder-layers``, ``--decoder-embed-dim``, ``--decoder-ffn-embed-dim``, ``--decoder-attention-heads``,
``--share-decoder-input-output-embed``, ``--max-target-positions``); the rest are these families' own (Hugging
Face's config key in brackets):

``--decoder-kv-heads``          key/value heads (``num_key_value_heads``): grouped-query attention
                                when fewer than the query heads, multi-query at 1
``--rope-theta``                base of the rotary frequencies (``rope_theta``)
``--rope-scaling-factor`` ...   stretch the rotary frequencies for a longer context (``rope_scaling``):
                                ``--rope-scaling llama3`` (Llama 3.1's, the default), ``yarn`` (YaRN, with
                                ``--rope-yarn-beta-fast/-slow`` and ``--rope-attention-factor``) or ``linear``
``--partial-rotary-factor``     the fraction of each head that rotates (``partial_rotary_factor``; GPT-NeoX's
                                ``rotary_pct``): the first int(head size x factor) features, the rest pass
``--rms-norm-eps``              RMSNorm's epsilon (``rms_norm_eps``)
``--attention-qkv-bias``        biases on q, k, v (Qwen2); no other linear layer has one
``--decoder-head-dim``          size of each attention head (``head_dim``) when it is not width / heads (Qwen3)
``--qk-norm``                   RMSNorm over each query and key head before the rotation (Qwen3)
``--mlp-activation``            the gated MLP's activation: SwiGLU (silu) or GeGLU (gelu_tanh, Gemma)
``--sliding-window``            each position attends to the last N positions only, itself included
                                (Mistral's ``sliding_window``); every layer alike unless --layer-types
``--layer-types``               which layers are local (``sliding_attention``, within --sliding-window) and
                                which global (``full_attention``), comma-separated, one per layer
                                (``layer_types`` of Qwen2/Qwen3 with ``use_sliding_window``, Gemma 3)

No torch here: ``--help`` reads these before torch is imported.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from toolkit.config.flag_types import bounded_float, positive_float, positive_int
from toolkit.core.errors import UserError

ROPE_SCALINGS = ("llama3", "yarn", "linear")
"""``--rope-scaling``: the frequency rescalings ``common/rope.py`` computes (its ``SCALINGS``)."""
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
"""``--mlp-activation``: the gated MLP's activations, names of ``common/mlp.py``'s one activation table."""
LAYER_TYPES = ("full_attention", "sliding_attention")  # Hugging Face's names
SCORE_FUNCTIONS = ("softmax", "sigmoid")
"""``--moe-score-func``: how ``common/moe.py``'s router turns logits into scores."""
ROPE_BASE = bounded_float(1.0, low_open=True, meaning=" (the base of the rotary frequencies, e.g. 10000)")
"""A rotary base: above 1 (a base of 1 turns every pair alike, below it the slow pairs turn fastest)."""
ROPE_FACTOR = bounded_float(1.0, meaning=" (how many times the context is stretched; 1 is no stretch)")
"""A scaling factor: at least 1, as transformers' rope validation (``_validate_{yarn,llama3}_rope_parameters``)."""


def absent_options(family: str, norms: str) -> Dict[str, str]:
    """transformer_lm's options a rotary decoder family does not have, and why: ``family`` names it ("the Llama
    family"), ``norms`` says where its blocks normalize (``toolkit.config.options`` says so in one line)."""
    return {
        **{
            name: f"{family} has no dropout"
            for name in ("dropout", "attention_dropout", "activation_dropout", "relu_dropout")
        },
        "decoder_normalize_before": norms,
        "decoder_learned_pos": f"{family} encodes positions with rotary embeddings",
        "activation_fn": "the MLP is gated: --mlp-activation silu (SwiGLU) or gelu_tanh (GeGLU)",
    }


@dataclass
class DecoderOptions:
    decoder_layers: int = field(default=2, metadata={"type": positive_int, "help": "num decoder layers"})
    decoder_embed_dim: int = field(default=64, metadata={"type": positive_int, "help": "decoder embedding dimension"})
    decoder_ffn_embed_dim: int = field(
        default=128, metadata={"type": positive_int, "help": "decoder embedding dimension for FFN"}
    )
    decoder_attention_heads: int = field(
        default=4, metadata={"type": positive_int, "help": "num decoder attention heads"}
    )
    decoder_kv_heads: Optional[int] = field(
        default=None,
        metadata={
            "type": positive_int,
            "help": "key/value heads of grouped-query attention (default: "
            "--decoder-attention-heads; 1 is multi-query attention)",
        },
    )
    rope_theta: float = field(
        default=10000.0, metadata={"type": ROPE_BASE, "help": "base of the rotary position frequencies"}
    )
    rope_scaling_factor: Optional[float] = field(
        default=None,
        metadata={
            "type": ROPE_FACTOR,
            "help": "RoPE frequency scaling (--rope-scaling): divide the low frequencies by "
            "this factor, the context stretched by it (default: no scaling)",
        },
    )
    rope_scaling: str = field(
        default="llama3",
        metadata={
            "choices": list(ROPE_SCALINGS),
            "help": "how --rope-scaling-factor rescales the "
            "frequencies: Llama 3.1's wavelength bands (llama3), YaRN's ramp over the "
            "frequency pairs with its attention factor (yarn), or every frequency divided by it (linear)",
        },
    )
    rope_yarn_beta_fast: float = field(
        default=32.0,
        metadata={
            "type": positive_float,
            "help": "YaRN: frequency pairs turning more often than this over the original "
            "context keep their frequency (beta_fast)",
        },
    )
    rope_yarn_beta_slow: float = field(
        default=1.0,
        metadata={
            "type": positive_float,
            "help": "YaRN: frequency pairs turning less often than this over the original "
            "context are divided by the factor (beta_slow)",
        },
    )
    rope_yarn_truncate: bool = field(
        default=True,
        metadata={
            "help": "YaRN: round the ramp's ends outwards to whole frequency pairs (truncate; "
            "--no-rope-yarn-truncate keeps them fractional, as gpt-oss)"
        },
    )
    rope_attention_factor: Optional[float] = field(
        default=None,
        metadata={
            "type": positive_float,
            "help": "YaRN: multiplier of the rotary cos/sin tables (attention_factor; "
            "default: 0.1 ln(--rope-scaling-factor) + 1)",
        },
    )
    rope_low_freq_factor: float = field(
        default=1.0,
        metadata={"type": positive_float, "help": "Llama 3.1 RoPE scaling: wavelengths above original/this are scaled"},
    )
    rope_high_freq_factor: float = field(
        default=4.0,
        metadata={"type": positive_float, "help": "Llama 3.1 RoPE scaling: wavelengths below original/this are kept"},
    )
    rope_original_max_positions: int = field(
        default=8192,
        metadata={
            "type": positive_int,
            "help": "RoPE scaling (llama3, yarn): the context length the model was trained "
            "at (original_max_position_embeddings)",
        },
    )
    rms_norm_eps: float = field(default=1e-5, metadata={"type": positive_float, "help": "epsilon of RMSNorm"})
    attention_qkv_bias: bool = field(
        default=False, metadata={"help": "biases on the query, key and value projections (Qwen2)"}
    )
    decoder_head_dim: Optional[int] = field(
        default=None,
        metadata={
            "type": positive_int,
            "help": "size of each attention head (default: --decoder-embed-dim / --decoder-attention-heads)",
        },
    )
    qk_norm: bool = field(
        default=False, metadata={"help": "RMSNorm over each query and key head before the rotation (Qwen3)"}
    )
    mlp_activation: str = field(
        default="silu",
        metadata={
            "choices": list(MLP_ACTIVATIONS),
            "help": "the gated MLP's activation: SwiGLU (silu) or GeGLU (gelu_tanh, Gemma)",
        },
    )
    sliding_window: Optional[int] = field(
        default=None,
        metadata={
            "type": positive_int,
            "help": "attend to the last N positions only, the own "
            "included, in every layer (Mistral; default: the whole context)",
        },
    )
    layer_types: Optional[str] = field(
        default=None,
        metadata={
            "help": "per layer, comma-separated: sliding_attention (within --sliding-window) "
            "or full_attention (default: every layer as --sliding-window says)"
        },
    )
    share_decoder_input_output_embed: bool = field(
        default=False, metadata={"help": "share decoder input and output embeddings"}
    )
    max_target_positions: Optional[int] = field(
        default=None,
        metadata={
            "type": positive_int,
            "help": "max number of tokens in the target sequence (default: --tokens-per-sample)",
        },
    )
    init_std: float = field(
        default=0.02,
        metadata={
            "help": "standard deviation of the initial weights (output layers of each block "
            "are scaled by 1/sqrt(2 x layers))"
        },
    )
    partial_rotary_factor: float = field(
        default=1.0,
        metadata={
            "help": "the fraction of each attention head that rotary embeddings rotate: the first "
            "int(head size x this) features (GPT-NeoX's rotary_pct, Phi's partial_rotary_factor); 1 rotates all"
        },
    )


def kv_heads(cfg: DecoderOptions) -> int:
    return cfg.decoder_kv_heads or cfg.decoder_attention_heads


def head_dim(cfg: DecoderOptions) -> int:
    """``--decoder-head-dim`` when given (Qwen3's heads are wider than width / heads), else width / heads."""
    return cfg.decoder_head_dim or cfg.decoder_embed_dim // cfg.decoder_attention_heads


def rotary_dim(cfg: DecoderOptions) -> int:
    """The features of a head that rotate: int(head size x --partial-rotary-factor), transformers' arithmetic."""
    return int(head_dim(cfg) * cfg.partial_rotary_factor)


def layer_windows(cfg: DecoderOptions) -> List[Optional[int]]:
    """Each layer's window: --sliding-window for a local layer, None (the whole context) for a global one."""
    if cfg.layer_types is None:
        return [cfg.sliding_window] * cfg.decoder_layers
    return [cfg.sliding_window if kind == "sliding_attention" else None for kind in cfg.layer_types.split(",")]


def _check_layer_types(cfg: DecoderOptions) -> None:
    if cfg.layer_types is None:
        return
    kinds = cfg.layer_types.split(",")
    wrong = sorted(set(kinds) - set(LAYER_TYPES))
    if wrong or len(kinds) != cfg.decoder_layers:
        raise UserError(
            f"--layer-types {cfg.layer_types}: give one of {' or '.join(LAYER_TYPES)} per layer "
            f"({cfg.decoder_layers}, --decoder-layers), comma-separated"
        )
    if "sliding_attention" in kinds and cfg.sliding_window is None:
        raise UserError(
            f"--layer-types {cfg.layer_types}: sliding_attention layers need --sliding-window N "
            "(how many positions a local layer sees)"
        )


def check_shapes(cfg: DecoderOptions) -> None:
    """One line per impossible shape, before anything is built."""
    _check_layer_types(cfg)
    C, H, G = cfg.decoder_embed_dim, cfg.decoder_attention_heads, kv_heads(cfg)
    if cfg.decoder_head_dim is None and (H < 1 or C % H):
        raise UserError(
            f"--decoder-embed-dim {C}: must be divisible by --decoder-attention-heads {H} "
            "(or give the head size, --decoder-head-dim)"
        )
    if cfg.decoder_head_dim is not None and cfg.decoder_head_dim % 2:
        raise UserError(f"--decoder-head-dim {cfg.decoder_head_dim}: must be even for rotary embeddings")
    if head_dim(cfg) % 2:
        raise UserError(
            f"--decoder-embed-dim {C} / --decoder-attention-heads {H}: the head size {C // H} must be "
            "even for rotary embeddings; change one of the two (or give --decoder-head-dim)"
        )
    if G < 1 or H % G:
        raise UserError(
            f"--decoder-kv-heads {G}: must divide --decoder-attention-heads {H} "
            "(each key/value head serves a whole group of query heads)"
        )
    _check_partial_rotary(cfg)
    _check_rope_scaling(cfg)


def _check_partial_rotary(cfg: DecoderOptions) -> None:
    factor = cfg.partial_rotary_factor
    if not 0 < factor <= 1 or rotary_dim(cfg) < 2 or rotary_dim(cfg) % 2:
        raise UserError(
            f"--partial-rotary-factor {factor}: must be in (0, 1] and rotate an even number of each head's "
            f"{head_dim(cfg)} features (int({head_dim(cfg)} x {factor}) = {int(head_dim(cfg) * factor)})"
        )


def _check_rope_scaling(cfg: DecoderOptions) -> None:
    """What each flag's type checks (a config not parsed from flags: a checkpoint's, the hub's), then the
    combinations. ``--rope-scaling yarn`` alone would be no scaling at all: it needs its factor."""
    for name, value, parse in (
        ("rope_theta", cfg.rope_theta, ROPE_BASE),
        ("rope_scaling_factor", cfg.rope_scaling_factor, ROPE_FACTOR),
        ("rms_norm_eps", cfg.rms_norm_eps, positive_float),
    ):
        if value is not None:
            try:
                parse(str(value))
            except argparse.ArgumentTypeError as e:
                raise UserError(f"--{name.replace('_', '-')} {e}") from None
    if cfg.rope_scaling == "yarn" and cfg.rope_scaling_factor is None:
        raise UserError(
            "--rope-scaling yarn: give --rope-scaling-factor F (the context stretched F times) and "
            "--rope-original-max-positions N (the context trained at); without a factor nothing is scaled"
        )
    if (
        cfg.rope_scaling == "yarn"
        and cfg.rope_scaling_factor is not None
        and cfg.rope_yarn_beta_fast < cfg.rope_yarn_beta_slow
    ):
        raise UserError(
            f"--rope-yarn-beta-fast {cfg.rope_yarn_beta_fast}: must not be below --rope-yarn-beta-slow "
            f"{cfg.rope_yarn_beta_slow} (the ramp runs from the fast-turning pairs to the slow ones)"
        )
    if (
        cfg.rope_scaling == "llama3"
        and cfg.rope_scaling_factor is not None
        and cfg.rope_high_freq_factor <= cfg.rope_low_freq_factor
    ):
        raise UserError(
            f"--rope-high-freq-factor {cfg.rope_high_freq_factor}: must be above "
            f"--rope-low-freq-factor {cfg.rope_low_freq_factor}"
        )


def set_shape(cfg: DecoderOptions, layers: int, dim: int, ffn: int, heads: int, kv: int) -> None:
    """A named size's layers, width, MLP width and head counts (the archs' shorthand)."""
    cfg.decoder_layers, cfg.decoder_embed_dim, cfg.decoder_ffn_embed_dim = layers, dim, ffn
    cfg.decoder_attention_heads, cfg.decoder_kv_heads = heads, kv
