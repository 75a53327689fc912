"""fairseq ``transformer_lm`` checkpoints built by hand, and a reference forward pass.

The key names and shapes come from fairseq's module definitions
(``TransformerDecoder``, ``TransformerDecoderLayerBase``, ``MultiheadAttention``,
``LearnedPositionalEmbedding``/``SinusoidalPositionalEmbedding``), not from the
toolkit, so a test that loads these files checks our mapping against fairseq's
layout. The reference forward uses separate q/k/v projections and an explicit
masked softmax.
"""

from __future__ import annotations

import argparse
import collections
import math
from typing import Dict, List

import torch
import torch.nn.functional as F


def fairseq_param_names(layers: int, learned: bool, tied: bool) -> List[str]:
    """fairseq's state-dict keys of a pre-norm transformer_lm, in its module order (buffers included)."""
    names = ["decoder.embed_tokens.weight"]
    names.append("decoder.embed_positions.weight" if learned else "decoder.embed_positions._float_tensor")
    for i in range(layers):
        p = f"decoder.layers.{i}."
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
            names += [f"{p}self_attn.{proj}.weight", f"{p}self_attn.{proj}.bias"]
        for module in ("self_attn_layer_norm", "fc1", "fc2", "final_layer_norm"):
            names += [f"{p}{module}.weight", f"{p}{module}.bias"]
    names += [
        "decoder.layer_norm.weight",
        "decoder.layer_norm.bias",
        "decoder.output_projection.weight",
        "decoder.version",
    ]
    return names


def fairseq_shapes(layers: int, C: int, F_: int, V: int, pad: int, max_pos: int, learned: bool) -> Dict[str, tuple]:
    shapes = {
        "decoder.embed_tokens.weight": (V, C),
        "decoder.output_projection.weight": (V, C),
        "decoder.layer_norm.weight": (C,),
        "decoder.layer_norm.bias": (C,),
        "decoder.version": (1,),
    }
    shapes["decoder.embed_positions.weight" if learned else "decoder.embed_positions._float_tensor"] = (
        (max_pos + pad + 1, C) if learned else (1,)
    )
    for i in range(layers):
        p = f"decoder.layers.{i}."
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
            shapes[f"{p}self_attn.{proj}.weight"], shapes[f"{p}self_attn.{proj}.bias"] = (C, C), (C,)
        for ln in ("self_attn_layer_norm", "final_layer_norm"):
            shapes[f"{p}{ln}.weight"], shapes[f"{p}{ln}.bias"] = (C,), (C,)
        shapes[f"{p}fc1.weight"], shapes[f"{p}fc1.bias"] = (F_, C), (F_,)
        shapes[f"{p}fc2.weight"], shapes[f"{p}fc2.bias"] = (C, F_), (C,)
    return shapes


def random_fairseq_model(layers=2, C=16, F_=24, V=40, pad=1, max_pos=32, learned=True, tied=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = fairseq_shapes(layers, C, F_, V, pad, max_pos, learned)
    sd = collections.OrderedDict()
    for name in fairseq_param_names(layers, learned, tied):
        if name == "decoder.version":
            sd[name] = torch.Tensor([3])
        elif name.endswith("_float_tensor"):
            sd[name] = torch.FloatTensor(1)
        elif name == "decoder.output_projection.weight" and tied:
            sd[name] = sd["decoder.embed_tokens.weight"]
        else:
            sd[name] = torch.randn(shapes[name], generator=g) * 0.3
            if "layer_norm.weight" in name:
                sd[name] += 1.0
    return sd


def sinusoidal(positions: torch.Tensor, C: int) -> torch.Tensor:
    half = C // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
    angles = positions.float()[:, None] * freq[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


def reference_logits(sd, tokens: torch.Tensor, heads: int, pad: int, learned: bool, tied: bool) -> torch.Tensor:
    """fairseq's pre-norm decoder on right-padded ``tokens`` [B, T], with separate q/k/v."""
    return reference_forward(sd, tokens, heads, pad, learned, tied)[0]


def reference_forward(sd, tokens: torch.Tensor, heads: int, pad: int, learned: bool, tied: bool):
    """(logits, extra) as fairseq's TransformerDecoder returns them: ``extra["inner_states"]`` is the
    embedded input and each layer's output, [T, B, C], before the final layer norm; ``attn`` is ``[None]``."""
    C = sd["decoder.embed_tokens.weight"].shape[1]
    B, T = tokens.shape
    x = sd["decoder.embed_tokens.weight"][tokens] * math.sqrt(C)
    positions = torch.arange(T) + pad + 1
    x = x + (sd["decoder.embed_positions.weight"][positions] if learned else sinusoidal(positions, C))
    inner_states = [x.transpose(0, 1)]
    layer = 0
    while f"decoder.layers.{layer}.fc1.weight" in sd:
        p = f"decoder.layers.{layer}."

        def lin(h, name):
            return F.linear(h, sd[p + name + ".weight"], sd[p + name + ".bias"])

        h = F.layer_norm(x, (C,), sd[p + "self_attn_layer_norm.weight"], sd[p + "self_attn_layer_norm.bias"])
        D = C // heads
        q = (lin(h, "self_attn.q_proj") * D**-0.5).view(B, T, heads, D).transpose(1, 2)
        k = lin(h, "self_attn.k_proj").view(B, T, heads, D).transpose(1, 2)
        v = lin(h, "self_attn.v_proj").view(B, T, heads, D).transpose(1, 2)
        scores = q @ k.transpose(-1, -2)
        scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        attn = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
        x = x + lin(attn, "self_attn.out_proj")
        h = F.layer_norm(x, (C,), sd[p + "final_layer_norm.weight"], sd[p + "final_layer_norm.bias"])
        x = x + lin(torch.relu(lin(h, "fc1")), "fc2")
        inner_states.append(x.transpose(0, 1))
        layer += 1
    x = F.layer_norm(x, (C,), sd["decoder.layer_norm.weight"], sd["decoder.layer_norm.bias"])
    out = sd["decoder.embed_tokens.weight"] if tied else sd["decoder.output_projection.weight"]
    return x @ out.t(), {"attn": [None], "inner_states": inner_states}


def model_options(layers=2, C=16, F_=24, heads=2, max_pos=32, learned=True, tied=False) -> Dict:
    """fairseq's TransformerLanguageModelConfig values (after base_lm_architecture)."""
    return {
        "_name": "transformer_lm",
        "activation_fn": "relu",
        "dropout": 0.1,
        "attention_dropout": 0.0,
        "activation_dropout": 0.0,
        "relu_dropout": 0.0,
        "decoder_embed_dim": C,
        "decoder_output_dim": C,
        "decoder_input_dim": C,
        "decoder_ffn_embed_dim": F_,
        "decoder_layers": layers,
        "decoder_attention_heads": heads,
        "decoder_normalize_before": True,
        "no_decoder_final_norm": False,
        "adaptive_softmax_cutoff": None,
        "no_token_positional_embeddings": False,
        "share_decoder_input_output_embed": tied,
        "character_embeddings": False,
        "adaptive_input": False,
        "tie_adaptive_weights": False,
        "decoder_learned_pos": learned,
        "layernorm_embedding": False,
        "no_scale_embedding": False,
        "decoder_layerdrop": 0.0,
        "decoder_layers_to_keep": None,
        "scale_fc": False,
        "scale_attn": False,
        "scale_heads": False,
        "scale_resids": False,
        "add_bos_token": False,
        "tokens_per_sample": max_pos,
        "max_target_positions": max_pos,
        "tpu": False,
    }


def task_options(data: str, tokens_per_sample: int) -> Dict:
    return {
        "_name": "language_modeling",
        "data": data,
        "sample_break_mode": "none",
        "tokens_per_sample": tokens_per_sample,
        "add_bos_token": False,
        "max_target_positions": None,
        "seed": 1,
    }


def fairseq_main_checkpoint(sd, model: Dict, task: Dict, optimizer_state=None) -> Dict:
    """fairseq >= 0.12 Trainer.state_dict(): ``args`` None, ``cfg`` a plain dict."""
    state = {
        "args": None,
        "cfg": {
            "_name": None,
            "common": {"seed": 1, "fp16": False},
            "task": task,
            "model": model,
            "criterion": {"_name": "cross_entropy"},
        },
        "model": sd,
        "criterion": None,
        "optimizer_history": [
            {
                "criterion_name": "CrossEntropyCriterion",
                "optimizer_name": "FairseqAdam",
                "lr_scheduler_state": {"best": 5.0},
                "num_updates": 7,
            }
        ],
        "task_state": {},
        "extra_state": {
            "metrics": {},
            "previous_training_time": 1.5,
            "train_iterator": {"epoch": 2, "iterations_in_epoch": 3},
        },
    }
    if optimizer_state is not None:
        state["last_optimizer_state"] = optimizer_state
    return state


def fairseq_010_checkpoint(sd, model: Dict, task: Dict, optimizer_state=None) -> Dict:
    """fairseq 0.10.0: options in an argparse.Namespace ``args`` (arch, task and model flags together)."""
    flat = {k: v for k, v in {**model, **task}.items() if k != "_name"}
    args = argparse.Namespace(
        arch="transformer_lm_gpt",
        task="language_modeling",
        criterion="cross_entropy",
        optimizer="adam",
        lr=[0.0005],
        **flat,
    )
    state = {
        "args": args,
        "model": sd,
        "optimizer_history": [
            {
                "criterion_name": "CrossEntropyCriterion",
                "optimizer_name": "FairseqAdam",
                "lr_scheduler_state": {"best": 5.0},
                "num_updates": 7,
            }
        ],
        "extra_state": {"train_iterator": {"epoch": 1, "iterations_in_epoch": 7}, "val_loss": 5.0},
    }
    if optimizer_state is not None:
        state["last_optimizer_state"] = optimizer_state
    return state
