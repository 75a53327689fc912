"""Write a toolkit checkpoint in fairseq's ``transformer_lm`` layout.

``toolkit-consolidate --to-fairseq OUT.pt`` (:func:`export`) writes the layout that fairseq's
``checkpoint_utils.load_model_ensemble`` reads::

    {"args": None,
     "cfg": {"_name": None,
             "common": {"seed", "fp16", "bf16", "cpu", "log_format", "log_interval", ...},
             "task": {"_name": "language_modeling", "data", "tokens_per_sample",
                      "sample_break_mode", "add_bos_token", "max_target_positions",
                      ... every LanguageModelingConfig field, resolved},
             "model": {"_name": "transformer_lm", "decoder_embed_dim", "decoder_layers", ...
                       every TransformerLanguageModelConfig field, resolved},
             "criterion": {"_name": "cross_entropy", "sentence_avg": False}},
     "model": OrderedDict, in fairseq's module order:
         decoder.embed_tokens.weight                          [V, C]
         decoder.embed_positions.weight                       [max_target_positions + pad + 1, C]  (learned)
         decoder.embed_positions._float_tensor                [1]  (sinusoidal; fairseq <= 0.10 needs it)
         decoder.layers.{i}.self_attn.{k,v,q,out}_proj.{weight,bias}   [C, C], [C]
         decoder.layers.{i}.self_attn_layer_norm.{weight,bias}         [C]
         decoder.layers.{i}.fc1.{weight,bias}                 [F, C], [F]
         decoder.layers.{i}.fc2.{weight,bias}                 [C, F], [C]
         decoder.layers.{i}.final_layer_norm.{weight,bias}    [C]
         decoder.layer_norm.{weight,bias}                     [C]  (pre-norm with a final norm)
         decoder.output_projection.weight                     [V, C]  (tied: embed_tokens.weight's values)
         decoder.version                                      tensor([3.])
     "optimizer_history": [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "FairseqAdam",
                            "lr_scheduler_state": {"best": best}, "num_updates": N}],
     "extra_state": {"train_iterator": {"epoch": E, ...}, "val_loss": ..., "best": ...},
     "task_state": {}, "criterion": None}

``decoder.version`` is 3: fairseq reads a missing or older version as "no final
LayerNorm" (and so do we when importing). A post-norm model (plain ``--arch transformer_lm``,
fairseq's default since 0.11) is written with ``decoder_normalize_before: False``; fairseq 0.10
would rebuild it pre-norm (its ``base_lm_architecture`` forced pre-norm), so read it with 0.11 or later.
Checked against real fairseq 0.12.2 by ``benchmarks/fairseq_parity/parity.py``.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from toolkit.compat.fairseq.checkpoint import is_fairseq_checkpoint, read_checkpoint
from toolkit.core.errors import UserError
from toolkit.compat.fairseq.weights import to_fairseq_weights

# Every field of fairseq's TransformerLanguageModelConfig, at fairseq's defaults (ours override them).
FAIRSEQ_MODEL_DEFAULTS: Dict[str, Any] = {
    "activation_fn": "relu",
    "dropout": 0.1,
    "attention_dropout": 0.0,
    "activation_dropout": 0.0,
    "relu_dropout": 0.0,
    "decoder_embed_dim": 512,
    "decoder_output_dim": 512,
    "decoder_input_dim": 512,
    "decoder_ffn_embed_dim": 2048,
    "decoder_layers": 6,
    "decoder_attention_heads": 8,
    "decoder_normalize_before": False,
    "no_decoder_final_norm": False,
    "adaptive_softmax_cutoff": None,
    "adaptive_softmax_dropout": 0.0,
    "adaptive_softmax_factor": 4.0,
    "no_token_positional_embeddings": False,
    "share_decoder_input_output_embed": False,
    "character_embeddings": False,
    "character_filters": "[(1, 64), (2, 128), (3, 192), (4, 256), (5, 256), (6, 256), (7, 256)]",
    "character_embedding_dim": 4,
    "char_embedder_highway_layers": 2,
    "adaptive_input": False,
    "adaptive_input_factor": 4.0,
    "adaptive_input_cutoff": None,
    "tie_adaptive_weights": False,
    "tie_adaptive_proj": False,
    "decoder_learned_pos": False,
    "layernorm_embedding": False,
    "no_scale_embedding": False,
    "checkpoint_activations": False,
    "offload_activations": False,
    "decoder_layerdrop": 0.0,
    "decoder_layers_to_keep": None,
    "quant_noise_pq": 0.0,
    "quant_noise_pq_block_size": 8,
    "quant_noise_scalar": 0.0,
    "min_params_to_wrap": 100000000,
    "base_layers": 0,
    "base_sublayers": 1,
    "base_shuffle": 1,
    "scale_fc": False,
    "scale_attn": False,
    "scale_heads": False,
    "scale_resids": False,
    "decoder_xformers_att_config": None,
    "tpu": False,
}
FAIRSEQ_TASK_DEFAULTS: Dict[str, Any] = {
    "data": None,
    "sample_break_mode": "none",
    "tokens_per_sample": 1024,
    "output_dictionary_size": -1,
    "self_target": False,
    "future_target": False,
    "past_target": False,
    "add_bos_token": False,
    "max_target_positions": None,
    "shorten_method": "none",
    "shorten_data_split_list": "",
    "pad_to_fixed_length": False,
    "pad_to_fixed_bsz": False,
    "seed": 1,
    "batch_size": None,
    "batch_size_valid": None,
    "dataset_impl": None,
    "data_buffer_size": 10,
    "tpu": False,
    "use_plasma_view": False,
    "plasma_path": "/tmp/plasma",
}
_COMMON_KEYS = ("seed", "cpu", "fp16", "bf16", "memory_efficient_fp16", "log_format", "log_interval")


def fairseq_cfg(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Our flat options as fairseq's ``cfg`` sections (every field resolved, as fairseq saves it)."""
    model = {k: cfg.get(k, default) for k, default in FAIRSEQ_MODEL_DEFAULTS.items()}
    model["decoder_input_dim"] = cfg.get("decoder_input_dim") or model["decoder_embed_dim"]
    model["decoder_output_dim"] = cfg.get("decoder_output_dim") or model["decoder_embed_dim"]
    task = {k: cfg.get(k, default) for k, default in FAIRSEQ_TASK_DEFAULTS.items()}
    task["batch_size"] = cfg.get("batch_size")
    for key in ("add_bos_token", "tokens_per_sample", "max_target_positions"):
        model[key] = (
            task[key] if key != "max_target_positions" else cfg.get("max_target_positions") or task["tokens_per_sample"]
        )
    return {
        "_name": None,
        "common": {k: cfg[k] for k in _COMMON_KEYS if k in cfg},
        "task": {"_name": "language_modeling", **task},
        "model": {"_name": "transformer_lm", **model},
        "criterion": {"_name": "cross_entropy", "sentence_avg": False},
    }


def to_fairseq_checkpoint(state: Dict[str, Any]) -> Dict[str, Any]:
    """A toolkit checkpoint (``cfg``/``model``/``extra_state``) in fairseq's layout (module docstring)."""
    cfg = dict(state["cfg"])
    extra = state.get("extra_state") or {}
    num_updates = int((extra.get("trainer") or {}).get("num_updates", 0))
    iterator = extra.get("train_iterator") or {"epoch": 1}
    return {
        "args": None,
        "cfg": fairseq_cfg(cfg),
        "model": to_fairseq_weights(state["model"], cfg),
        "criterion": None,
        "optimizer_history": [
            {
                "criterion_name": "CrossEntropyCriterion",
                "optimizer_name": "FairseqAdam",
                "lr_scheduler_state": {"best": extra.get("best")},
                "num_updates": num_updates,
            }
        ],
        "task_state": {},
        "extra_state": {
            "train_iterator": {
                "epoch": int(iterator.get("epoch", 1)),
                "version": 2,
                "iterations_in_epoch": int(iterator.get("iterations_in_epoch", 0)),
                "shuffle": True,
            },
            "val_loss": extra.get("val_loss"),
            "best": extra.get("best"),
            "previous_training_time": 0.0,
        },
    }


def export(source: str, output: str) -> Dict[str, int]:
    """Write ``source`` (a toolkit ``.pt``) as a fairseq checkpoint at ``output`` (atomically)."""
    from toolkit.core.fileio import atomic_write

    state = read_checkpoint(source)
    if is_fairseq_checkpoint(state) or "cfg" not in state or "model" not in state:
        raise UserError(f"{source}: not a toolkit checkpoint (no flat 'cfg' and 'model' entries)")
    converted = to_fairseq_checkpoint(state)
    with atomic_write(output, "wb") as f:
        torch.save(converted, f)
    return {
        "tensors": len(converted["model"]),
        "params": sum(v.numel() for k, v in converted["model"].items() if not k.endswith("version")),
    }
