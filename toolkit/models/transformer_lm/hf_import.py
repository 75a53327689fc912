"""``toolkit-export --from hf``: a transformers ``GPT2LMHeadModel`` folder read as a ``transformer_lm`` checkpoint
(the exporter, ``toolkit.export.hf_family``, writes it).

GPT-2 is our ``transformer_lm`` with learned positions, no embedding scale, pre-norm with a final
LayerNorm (eps 1e-5 in both), tanh-approximated GELU (``gelu_new`` = our ``gelu_accurate``) and
tied embeddings: no model option is missing. What differs is bookkeeping:

- Positions: GPT-2 reads its table from row t; ours reads row ``padding_idx + 1 + t`` of a table
  with ``padding_idx + 1`` extra rows. GPT-2's rows go there; the extra rows are zero.
- Vocabulary: our dictionary starts with fairseq's specials (<s>=0, <pad>=1, </s>=2, <unk>=3)
  and, as fairseq does for GPT-2 BPE, names every other token by its GPT-2 id ("464"). GPT-2's
  <|endoftext|> becomes </s> (the symbol our LMs see between documents). <s>, <pad> and <unk>
  have no GPT-2 row: they get <|endoftext|>'s (zeros when there is none), so they behave as a
  document boundary. Logits at GPT-2's ids are GPT-2's exactly; a softmax over our vocabulary
  also counts those three extra symbols.

The folder written holds ``model.pt`` (a checkpoint as the trainer writes it: ``cfg`` as a plain
dict, ``model``, a fresh-start ``extra_state``), ``dict.txt``, and GPT-2's BPE files with
``bpe.json`` when the input folder has ``vocab.json``/``merges.txt``: a data-bin-like folder for
``from_pretrained(OUT, "model.pt")``, ``--srcdict`` and ``--restore-file``.
"""

from __future__ import annotations

import os
import pickle
from typing import Dict, List, Optional, Tuple

import torch

from toolkit.core.errors import UserError, malformed_file, require
from toolkit.core.protocols import HFCheckpoint
from toolkit.models import matching_arch as family_size
from toolkit.models.hf_checkpoint import CHECKPOINT, check_finite, checkpoint, training_flags

ACTIVATIONS = {
    "gelu_new": "gelu_accurate",
    "gelu_pytorch_tanh": "gelu_accurate",
    "gelu": "gelu",
    "relu": "relu",
    "tanh": "tanh",
    "silu": "swish",
    "swish": "swish",
    "linear": "linear",
}


def check_config(folder: str, config) -> None:
    """Refuse (one line, naming the setting) what our model cannot compute exactly."""
    where = os.path.join(folder, "config.json")
    if config.model_type != "gpt2":
        raise UserError(
            f"{where}: model_type {config.model_type!r}; transformer_lm reads GPT2LMHeadModel folders "
            "(toolkit-export --from hf picks the family by model_type)"
        )
    if config.activation_function not in ACTIVATIONS:
        raise UserError(f"{where}: activation_function {config.activation_function!r} has no toolkit equivalent")
    if abs(config.layer_norm_epsilon - 1e-5) > 1e-12:
        raise UserError(f"{where}: layer_norm_epsilon {config.layer_norm_epsilon} (the toolkit's LayerNorm uses 1e-5)")
    if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx:
        raise UserError(
            f"{where}: scale_attn_weights={config.scale_attn_weights}, scale_attn_by_inverse_layer_idx="
            f"{config.scale_attn_by_inverse_layer_idx} (the toolkit scales attention by 1/sqrt(head size))"
        )
    if config.add_cross_attention:
        raise UserError(f"{where}: add_cross_attention is set; the toolkit's LM has no cross-attention")


def vocabulary(vocab_size: int, eot: Optional[int]) -> Tuple[List[str], torch.Tensor]:
    """Our symbols after the specials, and our index of every GPT-2 id."""
    symbols = [str(i) for i in range(vocab_size) if i != eot]
    index = torch.tensor([2 if i == eot else 4 + i - (eot is not None and i > eot) for i in range(vocab_size)])
    return symbols, index


def _remap_rows(table: torch.Tensor, index: torch.Tensor, eot: Optional[int]) -> torch.Tensor:
    out = torch.zeros(len(index) + 4 - (eot is not None), table.size(1), dtype=table.dtype)
    if eot is not None:
        out[[0, 1, 3]] = table[eot]
    out[index] = table
    return out


def convert_state(
    hf_state: Dict[str, torch.Tensor], config, index: torch.Tensor, eot: Optional[int], padding_idx: int = 1
) -> Dict[str, torch.Tensor]:
    """GPT-2's tensors under our names (Conv1D [in, out] transposed to Linear [out, in])."""
    C, L, n = config.n_embd, config.n_layer, config.n_positions
    state = {"embed_tokens.weight": _remap_rows(hf_state["transformer.wte.weight"], index, eot)}
    positions = torch.zeros(n + padding_idx + 1, C)
    positions[padding_idx + 1 :] = hf_state["transformer.wpe.weight"][:n]
    state["embed_positions.weight"] = positions
    for i in range(L):
        src, dst = f"transformer.h.{i}", f"layers.{i}"
        for ours, theirs in GPT2_NORMS:
            state[f"{dst}.{ours}.weight"] = hf_state[f"{src}.{theirs}.weight"]
            state[f"{dst}.{ours}.bias"] = hf_state[f"{src}.{theirs}.bias"]
        for ours, theirs in GPT2_CONV1D:
            state[f"{dst}.{ours}.weight"] = hf_state[f"{src}.{theirs}.weight"].t().contiguous()
            state[f"{dst}.{ours}.bias"] = hf_state[f"{src}.{theirs}.bias"]
    state["layer_norm.weight"] = hf_state["transformer.ln_f.weight"]
    state["layer_norm.bias"] = hf_state["transformer.ln_f.bias"]
    if not config.tie_word_embeddings:
        state["output_projection.weight"] = _remap_rows(hf_state["lm_head.weight"], index, eot)
    return {k: v.float().contiguous() for k, v in state.items()}


def model_options(config) -> Dict[str, object]:
    return dict(
        decoder_layers=config.n_layer,
        decoder_embed_dim=config.n_embd,
        decoder_input_dim=config.n_embd,
        decoder_output_dim=config.n_embd,  # no project_in/out_dim
        decoder_ffn_embed_dim=config.n_inner or 4 * config.n_embd,
        decoder_attention_heads=config.n_head,
        decoder_learned_pos=True,
        no_scale_embedding=True,
        decoder_normalize_before=True,
        no_decoder_final_norm=False,
        share_decoder_input_output_embed=bool(config.tie_word_embeddings),
        activation_fn=ACTIVATIONS[config.activation_function],
        dropout=float(config.resid_pdrop),
        attention_dropout=float(config.attn_pdrop),
        activation_dropout=0.0,
        max_target_positions=config.n_positions,
        no_token_positional_embeddings=False,
    )


# GPT-2's names of a block's modules, as data: (ours, theirs); Conv1D layers hold our Linear's weight transposed
GPT2_NORMS = (("self_attn_layer_norm", "ln_1"), ("final_layer_norm", "ln_2"))
GPT2_CONV1D = (
    ("self_attn.qkv_proj", "attn.c_attn"),
    ("self_attn.out_proj", "attn.c_proj"),
    ("fc1", "mlp.c_fc"),
    ("fc2", "mlp.c_proj"),
)
GPT2_SIZES = ("decoder_layers", "decoder_embed_dim", "decoder_ffn_embed_dim", "decoder_attention_heads")


def _gpt2_size(arch: str) -> bool:
    return arch.startswith("transformer_lm_gpt") and not arch.startswith("transformer_lm_gpt3")


def matching_arch(given: Dict[str, object]) -> str:
    """The named architecture with GPT-2's sizes (OpenAI's 124M is ``transformer_lm_gpt``), else ``transformer_lm``."""
    return family_size("transformer_lm", given, compared=GPT2_SIZES, among=_gpt2_size)


def _dictionary(symbols: List[str]):
    from toolkit.data.dictionary import Dictionary

    d = Dictionary()
    for sym in symbols:
        d.add_symbol(sym)
    return d


def _bpe(folder: str) -> Tuple[Optional[Tuple[str, Dict[str, str]]], str]:
    """GPT-2's vocab.json/merges.txt as the data-bin's encoder.json/vocab.bpe (``--bpe gpt2``), and the note."""
    vocab, merges = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    if not (os.path.isfile(vocab) and os.path.isfile(merges)):
        return None, "no vocab.json/merges.txt: dict.txt names GPT-2 ids, tokenize with --bpe gpt2 yourself"
    return (
        "gpt2",
        {"gpt2_encoder_json": vocab, "gpt2_vocab_bpe": merges},
    ), "copied GPT-2's BPE as encoder.json + vocab.bpe (--bpe gpt2)"


def _load_hf_model(transformers, folder: str):
    """The GPT-2 model, or one line: a forged ``pytorch_model.bin`` is refused by ``weights_only`` as an
    UnpicklingError (nothing runs), a damaged file as an OSError/RuntimeError."""
    try:
        model, info = transformers.GPT2LMHeadModel.from_pretrained(
            folder, dtype=torch.float32, output_loading_info=True
        )
    except (pickle.UnpicklingError, OSError, RuntimeError, ValueError, EOFError) as e:
        text = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise UserError(
            f"--path {folder}: cannot load the model's weights ({type(e).__name__}: {text}); give a "
            f"folder written by save_pretrained (model.safetensors or an intact pytorch_model.bin)"
        ) from None
    missing = sorted(k for k in info.get("missing_keys", ()) if not k.endswith("attn.bias"))  # masks are buffers
    if missing:  # transformers would start them from random values: not the model the folder holds
        raise UserError(
            f"--path {folder}: the weights do not match config.json (missing {missing[:3]}); give the "
            "config.json saved with these weights"
        )
    return model


def read_gpt2(folder: str, out_dir: str, tokens_per_sample: Optional[int], advance) -> HFCheckpoint:
    """The GPT2LMHeadModel in ``folder`` as our checkpoint (``out_dir``: where it will be written)."""
    transformers = require("transformers", "transformers")
    with malformed_file(
        os.path.join(folder, "config.json"),
        "give the config.json transformers saved with the model",
        errors=(Exception,),
    ):  # transformers checks each value's type, in its own exception
        config = transformers.AutoConfig.from_pretrained(folder)
    check_config(folder, config)
    hf = _load_hf_model(transformers, folder)
    advance(f"{folder}: GPT2LMHeadModel, {config.n_layer} layers, vocabulary of {config.vocab_size}")
    eot = (
        config.eos_token_id
        if isinstance(config.eos_token_id, int) and 0 <= config.eos_token_id < config.vocab_size
        else None
    )
    symbols, index = vocabulary(config.vocab_size, eot)
    weights = [os.path.join(folder, n) for n in ("model.safetensors", "pytorch_model.bin")]
    for name, tensor in hf.state_dict().items():
        check_finite(name, tensor, next((w for w in weights if os.path.isfile(w)), folder))
    state = convert_state(hf.state_dict(), config, index, eot)
    given = model_options(config)
    arch = matching_arch(given)
    ckpt = checkpoint(state, arch, given, out_dir, tokens_per_sample or config.n_positions)
    advance(f"converted to --arch {arch} ({len(state)} tensors)")
    bpe, copied = _bpe(folder)
    log = (
        f"fine-tune with: toolkit-train DATA {training_flags(arch, given)} --tokens-per-sample "
        f"{config.n_positions} --finetune-from-model {os.path.join(out_dir, CHECKPOINT)} "
        f"(binarize DATA with --srcdict {os.path.join(out_dir, 'dict.txt')})",
    )
    return HFCheckpoint(
        ckpt,
        _dictionary(symbols),
        f"wrote {CHECKPOINT} and dict.txt ({len(symbols) + 4} symbols)",
        copied,
        files={},
        bpe=bpe,
        log=log,
    )
