"""The ``transformer_lm`` family in Hugging Face transformers' classes: which class computes exactly what a
model computes, its config values and its state dict in that class's names (``toolkit-export --format hf``
writes the folder: ``toolkit.export.hf_format``; ``hf_import.py`` reads GPT-2 folders for ``--from hf``).

Which class expresses which ``transformer_lm`` (checked option by option in :func:`why_not`):

- ``XGLMForCausalLM``: sinusoidal positions. XGLM's table is ours ([sin | cos] halves, frequency
  step log(10000)/(half-1)) read at rows ``t + 2``; ours is read at ``t + padding_idx + 1``, so the
  dictionary's pad must be 1. Pre-norm with a final LayerNorm only. Embedding scale √d or none
  (``scale_embedding``); tied or untied output (``tie_word_embeddings``).
- ``OPTForCausalLM``: learned positions. OPT's table has ``max_positions + 2`` rows read at
  ``t + 2``: ours, row for row, when pad is 1. Pre-norm (with or without the final LayerNorm) or
  post-norm. No embedding scale (none is folded into an untied embedding exactly: scaling the
  looked-up row or the stored row is the same multiply).
- ``GPT2LMHeadModel``: learned positions read from row ``t``: our rows ``pad+1 ...`` are written
  as its table. Fused q/k/v in ``Conv1D`` layout ([in, out], our ``Linear`` transposed). Pre-norm
  with a final LayerNorm only; no embedding scale (folded when untied, as for OPT).

The activation goes through the config (relu, exact gelu, tanh-approximated gelu as
``gelu_pytorch_tanh``, ...). Anything else is refused with one line naming the option; before the
folder appears, transformers loads it and its logits are compared with ours (fp32). ``TransformerLMAdapter`` is
the family's adapter class (``toolkit.models.common.hf_adapter.HFAdapter``).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from toolkit.core.errors import UserError
from toolkit.core.protocols import HFCheckpoint, HFWeights
from toolkit.models.common.hf_adapter import HFAdapter
from toolkit.models.transformer_lm.hf_import import GPT2_CONV1D, GPT2_NORMS, read_gpt2

HF_ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_accurate": "gelu_pytorch_tanh",
    "gelu_fast": "gelu_pytorch_tanh",
    "tanh": "tanh",
    "swish": "silu",
    "linear": "linear",
}
CLASS_NAMES = {"xglm": "XGLMForCausalLM", "opt": "OPTForCausalLM", "gpt2": "GPT2LMHeadModel"}
# A block's modules in XGLM's and OPT's names (fairseq's, ours); GPT-2's are hf_import.py's GPT2_NORMS, GPT2_CONV1D
FAIRSEQ_LIKE_BLOCK = ("self_attn.out_proj", "self_attn_layer_norm", "fc1", "fc2", "final_layer_norm")


def why_not(model, name: str) -> Optional[str]:
    """The option that keeps class ``name`` from computing exactly what ``model`` does, or None."""
    c = model.cfg
    if c.no_token_positional_embeddings:
        return "--no-token-positional-embeddings (it always adds positions)"
    if name == "xglm" and c.decoder_learned_pos:
        return "--decoder-learned-pos (its positions are sinusoidal)"
    if name != "xglm" and not c.decoder_learned_pos:
        return "sinusoidal positions, no --decoder-learned-pos (its positions are learned)"
    if name in ("xglm", "opt") and model.padding_idx != 1:
        return f"dictionary pad index {model.padding_idx} (its positions start at 2 = pad 1 + 1)"
    if name != "xglm" and model.embed_scale != 1.0 and model.output_projection is None:
        return (
            "embedding scale without --no-scale-embedding, with --share-decoder-input-output-embed "
            "(it has no scale, and folding one into a tied table would scale the output too)"
        )
    if name in ("xglm", "gpt2") and not c.decoder_normalize_before:
        return "--no-decoder-normalize-before (it is pre-norm only)"
    if name in ("xglm", "gpt2") and model.layer_norm is None:
        return "--no-decoder-final-norm (it always has a final LayerNorm)"
    return None


def choose_class(model, requested: str = "auto") -> str:
    """XGLM for sinusoidal positions, OPT (then GPT-2) for learned ones; a UserError naming the option."""
    if model.cfg.activation_fn not in HF_ACTIVATIONS:
        raise UserError(
            f"--format hf: --activation-fn {model.cfg.activation_fn} has no transformers equivalent; nothing written"
        )
    candidates = (
        [requested] if requested != "auto" else (["opt", "gpt2"] if model.cfg.decoder_learned_pos else ["xglm"])
    )
    reasons = []
    for name in candidates:
        reason = why_not(model, name)
        if reason is None:
            return name
        reasons.append(f"{CLASS_NAMES[name]}: {reason}")
    raise UserError(
        f"--format hf: no transformers class computes this model exactly ({'; '.join(reasons)}); nothing written"
    )


def _split_qkv(state: Dict[str, torch.Tensor], prefix: str, out: Dict[str, torch.Tensor], dest: str) -> None:
    """Our fused rows [q | k | v] as separate q_proj / k_proj / v_proj."""
    for kind in ("weight", "bias"):
        q, k, v = state[f"{prefix}.qkv_proj.{kind}"].chunk(3, dim=0)
        out.update({f"{dest}.q_proj.{kind}": q, f"{dest}.k_proj.{kind}": k, f"{dest}.v_proj.{kind}": v})


def _copy(state, src: str, out, dest: str, kinds=("weight", "bias")) -> None:
    for kind in kinds:
        out[f"{dest}.{kind}"] = state[f"{src}.{kind}"]


def _embedding(model, state) -> torch.Tensor:
    """The input table, with the embedding scale folded in when the class has none (untied only)."""
    return state["embed_tokens.weight"] * model.embed_scale


def _fairseq_like_state(model, state, base: str, fold_scale: bool) -> Dict[str, torch.Tensor]:
    """XGLM's and OPT's names (``{base}.layers.N.self_attn.q_proj`` ...), which are fairseq's."""
    out = {f"{base}.embed_tokens.weight": _embedding(model, state) if fold_scale else state["embed_tokens.weight"]}
    for i in range(len(model.layers)):
        src, dst = f"layers.{i}", f"{base}.layers.{i}"
        _split_qkv(state, f"{src}.self_attn", out, f"{dst}.self_attn")
        for name in FAIRSEQ_LIKE_BLOCK:
            _copy(state, f"{src}.{name}", out, f"{dst}.{name}")
    return out


def _lm_head(model, state, out) -> None:
    if model.output_projection is not None:
        out["lm_head.weight"] = state["output_projection.weight"]


def xglm(model, state) -> Tuple[str, dict, Dict[str, torch.Tensor]]:
    out = _fairseq_like_state(model, state, "model", fold_scale=False)
    _copy(state, "layer_norm", out, "model.layer_norm")
    _lm_head(model, state, out)
    c = model.cfg
    config = dict(
        model_type="xglm",
        d_model=c.decoder_embed_dim,
        ffn_dim=c.decoder_ffn_embed_dim,
        num_layers=c.decoder_layers,
        attention_heads=c.decoder_attention_heads,
        scale_embedding=model.embed_scale != 1.0,
        dropout=c.dropout,
        attention_dropout=c.attention_dropout,
        activation_dropout=c.activation_dropout,
        layerdrop=0.0,
    )
    return "XGLMForCausalLM", config, out


def opt(model, state) -> Tuple[str, dict, Dict[str, torch.Tensor]]:
    out = _fairseq_like_state(model, state, "model.decoder", fold_scale=True)
    out["model.decoder.embed_positions.weight"] = state["embed_positions.weight"]
    if model.layer_norm is not None:
        _copy(state, "layer_norm", out, "model.decoder.final_layer_norm")
    _lm_head(model, state, out)
    c = model.cfg
    config = dict(
        model_type="opt",
        hidden_size=c.decoder_embed_dim,
        word_embed_proj_dim=c.decoder_embed_dim,
        ffn_dim=c.decoder_ffn_embed_dim,
        num_hidden_layers=c.decoder_layers,
        num_attention_heads=c.decoder_attention_heads,
        do_layer_norm_before=c.decoder_normalize_before,
        _remove_final_layer_norm=c.decoder_normalize_before and model.layer_norm is None,
        dropout=c.dropout,
        attention_dropout=c.attention_dropout,
        layerdrop=0.0,
        enable_bias=True,
    )
    return "OPTForCausalLM", config, out


def gpt2(model, state) -> Tuple[str, dict, Dict[str, torch.Tensor]]:
    first = model.padding_idx + 1
    n = model.max_positions()
    out = {
        "transformer.wte.weight": _embedding(model, state),
        "transformer.wpe.weight": state["embed_positions.weight"][first : first + n],
    }
    for i in range(len(model.layers)):
        src, dst = f"layers.{i}", f"transformer.h.{i}"
        for ours, theirs in GPT2_NORMS:
            _copy(state, f"{src}.{ours}", out, f"{dst}.{theirs}")
        for ours, theirs in GPT2_CONV1D:  # Conv1D: weight is [in, out]
            out[f"{dst}.{theirs}.weight"] = state[f"{src}.{ours}.weight"].t()
            out[f"{dst}.{theirs}.bias"] = state[f"{src}.{ours}.bias"]
    _copy(state, "layer_norm", out, "transformer.ln_f")
    _lm_head(model, state, out)
    c = model.cfg
    config = dict(
        model_type="gpt2",
        n_embd=c.decoder_embed_dim,
        n_inner=c.decoder_ffn_embed_dim,
        n_layer=c.decoder_layers,
        n_head=c.decoder_attention_heads,
        n_positions=n,
        resid_pdrop=c.dropout,
        embd_pdrop=c.dropout,
        attn_pdrop=c.attention_dropout,
        layer_norm_epsilon=1e-5,
        scale_attn_weights=True,
    )
    return "GPT2LMHeadModel", config, out


CONVERTERS: Dict[str, Callable] = {"xglm": xglm, "opt": opt, "gpt2": gpt2}


def hf_weights(model, hf_class: str, dictionary, first_symbol: int) -> HFWeights:
    """The class that computes ``model`` exactly (``hf_class``, or the first that can), its config and weights.
    ``bos_token_id`` is what our LMs see before a text; the tokenizer is written from the data-bin's."""
    name = choose_class(model, hf_class)
    architecture, config, state = CONVERTERS[name](model, model.state_dict())
    config = {
        **config,
        "vocab_size": len(dictionary),
        "max_position_embeddings": model.max_positions(),
        "activation_function": HF_ACTIVATIONS[model.cfg.activation_fn],
        "tie_word_embeddings": model.output_projection is None,
        "pad_token_id": dictionary.pad(),
        "bos_token_id": first_symbol,
        "eos_token_id": dictionary.eos(),
        "decoder_start_token_id": first_symbol,
        "use_cache": True,
    }
    return HFWeights(architecture, config, state)


class TransformerLMAdapter(HFAdapter):
    """The ``transformer_lm`` family's Hugging Face adapter: GPT-2 folders in (``hf_import.py``), XGLM, OPT or GPT-2
    out, whichever computes the model exactly (above)."""

    FAMILY = "transformer_lm"
    CLASSES = {"gpt2": "GPT2LMHeadModel"}

    def read(self, folder: str, config: Dict, out_dir: str, tokens_per_sample: Optional[int], advance) -> HFCheckpoint:
        return read_gpt2(folder, out_dir, tokens_per_sample, advance)

    def write(self, model, hf_class: str, dictionary, first_symbol: int, data_dir: str) -> HFWeights:
        return hf_weights(model, hf_class, dictionary, first_symbol)
