"""``--format hf``: a transformers folder whose class computes exactly what our model computes.

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
folder appears, transformers loads it and its logits are compared with ours (fp32).

Ids are the dictionary's: <s>=0, <pad>=1, </s>=2, <unk>=3. ``bos_token_id`` is the symbol our
LMs see before a sentence's first token (</s>, or <s> with ``--add-bos-token``), as in fairseq.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Callable, Dict, Optional, Tuple

import torch

from toolkit.core.errors import UserError
from toolkit.export.common import DTYPES, StepProgress, require
from toolkit.export.target import export_directory

logger = logging.getLogger(__name__)

HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_accurate": "gelu_pytorch_tanh",
                  "gelu_fast": "gelu_pytorch_tanh", "tanh": "tanh", "swish": "silu", "linear": "linear"}
CLASS_NAMES = {"xglm": "XGLMForCausalLM", "opt": "OPTForCausalLM", "gpt2": "GPT2LMHeadModel"}
TOLERANCE = 1e-4


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
        return ("embedding scale without --no-scale-embedding, with --share-decoder-input-output-embed "
                "(it has no scale, and folding one into a tied table would scale the output too)")
    if name in ("xglm", "gpt2") and not c.decoder_normalize_before:
        return "--no-decoder-normalize-before (it is pre-norm only)"
    if name in ("xglm", "gpt2") and model.layer_norm is None:
        return "--no-decoder-final-norm (it always has a final LayerNorm)"
    return None


def choose_class(model, requested: str = "auto") -> str:
    """XGLM for sinusoidal positions, OPT (then GPT-2) for learned ones; a UserError naming the option."""
    if model.cfg.activation_fn not in HF_ACTIVATIONS:
        raise UserError(f"--format hf: --activation-fn {model.cfg.activation_fn} has no transformers equivalent; "
                        f"nothing written")
    candidates = [requested] if requested != "auto" else (
        ["opt", "gpt2"] if model.cfg.decoder_learned_pos else ["xglm"])
    reasons = []
    for name in candidates:
        reason = why_not(model, name)
        if reason is None:
            return name
        reasons.append(f"{CLASS_NAMES[name]}: {reason}")
    raise UserError(f"--format hf: no transformers class computes this model exactly ({'; '.join(reasons)}); "
                    f"nothing written")


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
        for name in ("self_attn.out_proj", "self_attn_layer_norm", "fc1", "fc2", "final_layer_norm"):
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
    config = dict(model_type="xglm", d_model=c.decoder_embed_dim, ffn_dim=c.decoder_ffn_embed_dim,
                  num_layers=c.decoder_layers, attention_heads=c.decoder_attention_heads,
                  scale_embedding=model.embed_scale != 1.0, dropout=c.dropout, attention_dropout=c.attention_dropout,
                  activation_dropout=c.activation_dropout, layerdrop=0.0)
    return "XGLMForCausalLM", config, out


def opt(model, state) -> Tuple[str, dict, Dict[str, torch.Tensor]]:
    out = _fairseq_like_state(model, state, "model.decoder", fold_scale=True)
    out["model.decoder.embed_positions.weight"] = state["embed_positions.weight"]
    if model.layer_norm is not None:
        _copy(state, "layer_norm", out, "model.decoder.final_layer_norm")
    _lm_head(model, state, out)
    c = model.cfg
    config = dict(model_type="opt", hidden_size=c.decoder_embed_dim, word_embed_proj_dim=c.decoder_embed_dim,
                  ffn_dim=c.decoder_ffn_embed_dim, num_hidden_layers=c.decoder_layers,
                  num_attention_heads=c.decoder_attention_heads, do_layer_norm_before=c.decoder_normalize_before,
                  _remove_final_layer_norm=c.decoder_normalize_before and model.layer_norm is None,
                  dropout=c.dropout, attention_dropout=c.attention_dropout, layerdrop=0.0, enable_bias=True)
    return "OPTForCausalLM", config, out


def gpt2(model, state) -> Tuple[str, dict, Dict[str, torch.Tensor]]:
    first = model.padding_idx + 1
    n = model.max_positions()
    out = {"transformer.wte.weight": _embedding(model, state),
           "transformer.wpe.weight": state["embed_positions.weight"][first:first + n]}
    for i in range(len(model.layers)):
        src, dst = f"layers.{i}", f"transformer.h.{i}"
        _copy(state, f"{src}.self_attn_layer_norm", out, f"{dst}.ln_1")
        _copy(state, f"{src}.final_layer_norm", out, f"{dst}.ln_2")
        for ours, theirs in (("self_attn.qkv_proj", "attn.c_attn"), ("self_attn.out_proj", "attn.c_proj"),
                             ("fc1", "mlp.c_fc"), ("fc2", "mlp.c_proj")):  # Conv1D: weight is [in, out]
            out[f"{dst}.{theirs}.weight"] = state[f"{src}.{ours}.weight"].t()
            out[f"{dst}.{theirs}.bias"] = state[f"{src}.{ours}.bias"]
    _copy(state, "layer_norm", out, "transformer.ln_f")
    _lm_head(model, state, out)
    c = model.cfg
    config = dict(model_type="gpt2", n_embd=c.decoder_embed_dim, n_inner=c.decoder_ffn_embed_dim,
                  n_layer=c.decoder_layers, n_head=c.decoder_attention_heads, n_positions=n,
                  resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.attention_dropout,
                  layer_norm_epsilon=1e-5, scale_attn_weights=True)
    return "GPT2LMHeadModel", config, out


CONVERTERS: Dict[str, Callable] = {"xglm": xglm, "opt": opt, "gpt2": gpt2}


def full_config(loaded, architecture: str, config: dict, dtype: str) -> dict:
    model, d = loaded.model, loaded.dictionary
    first_symbol = loaded.first_symbol
    return {**config, "architectures": [architecture], "vocab_size": len(d),
            "max_position_embeddings": model.max_positions(), "activation_function":
            HF_ACTIVATIONS[model.cfg.activation_fn], "tie_word_embeddings": model.output_projection is None,
            "pad_token_id": d.pad(), "bos_token_id": first_symbol, "eos_token_id": d.eos(),
            "decoder_start_token_id": first_symbol, "dtype": {"fp32": "float32", "bf16": "bfloat16",
                                                               "fp16": "float16"}[dtype], "use_cache": True}


def _write_weights(state: Dict[str, torch.Tensor], path: str, dtype: str) -> None:
    save_file = require("safetensors.torch", "safetensors").save_file
    # Each tensor on its own storage: split and transposed views of one tensor share it.
    tensors = {k: v.detach().to(DTYPES[dtype]).contiguous().clone() for k, v in state.items()}
    save_file(tensors, path, metadata={"format": "pt"})


def verify(folder: str, model: torch.nn.Module) -> float:
    """Load the folder with transformers and compare logits with ours on a random batch (fp32)."""
    transformers = require("transformers", "transformers")
    hf_logging = transformers.utils.logging
    hf_logging.disable_progress_bar()  # its per-tensor "Loading weights" bar, inside our own progress
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    finally:
        hf_logging.enable_progress_bar()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.embed_tokens.num_embeddings, (2, min(12, model.max_positions())), generator=g)
    with torch.no_grad():  # an all-ones mask: the same computation as none, without HF's padding warning
        diff = (hf(tokens, attention_mask=torch.ones_like(tokens)).logits - model(tokens)).abs().max().item()
    if not diff <= TOLERANCE:
        raise RuntimeError(f"{folder}: transformers logits differ from ours by {diff:.3g}; nothing written")
    return diff


def write_folder(tmp: str, model, architecture: str, config: dict, state: Dict[str, torch.Tensor], dtype: str,
                 tokenizer: Callable[[str], str], progress) -> None:
    """Weights, config.json and the tokenizer into ``tmp`` (one progress step each), then the transformers check."""
    progress.advance(f"{architecture}: {len(state)} tensors")
    _write_weights(state, os.path.join(tmp, "model.safetensors"), dtype)
    with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    progress.advance(f"wrote config.json and model.safetensors ({dtype})")
    progress.advance(tokenizer(tmp))
    if dtype == "fp32":
        progress.advance(f"transformers {architecture} loads it; max |logits diff| {verify(tmp, model):.2g}")
    else:
        progress.advance(f"not compared with transformers ({dtype} weights; compare an fp32 export)")


def export_hf(loaded, out_dir: str, hf_class: str = "auto", dtype: str = "fp32") -> str:
    """Write config.json, model.safetensors and (where the BPE maps to one) the tokenizer files."""
    from toolkit.export.hf_tokenizer import write_tokenizer

    require("transformers", "transformers")
    model = loaded.model
    name = choose_class(model, hf_class)
    with StepProgress(4, "hf") as progress, export_directory(out_dir) as tmp:
        architecture, config, state = CONVERTERS[name](model, model.state_dict())
        write_folder(tmp, model, architecture, full_config(loaded, architecture, config, dtype), state, dtype,
                     lambda folder: write_tokenizer(loaded, folder), progress)
    return out_dir
