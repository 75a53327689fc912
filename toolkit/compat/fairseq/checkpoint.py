"""fairseq ``transformer_lm`` checkpoints in and out.

Reading (``toolkit-eval-lm --path``, the hub, ``load_fairseq_into_trainer``): a
file written by fairseq 0.10 (options in ``args``, an ``argparse.Namespace``) or
by fairseq 0.10.1-0.12/main (options in ``cfg``: a DictConfig or plain dict with
``model``/``task`` sections) is read by :mod:`toolkit.compat.fairseq.pickle_reader`
(a restricted unpickler), its options become our ``TransformerLMConfig`` values
(:func:`toolkit_cfg`) and its weights our names (the family's
:mod:`toolkit.compat.fairseq.weights`).
fairseq features we do not implement are refused with one line naming the flag.

Writing (``toolkit-consolidate --to-fairseq``) is :mod:`toolkit.compat.fairseq.export`,
which documents the key layout it writes.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch

from toolkit.checkpoint import consolidated, model_fit
from toolkit.compat.fairseq import pickle_reader as fairseq_pickle
from toolkit.core.errors import UserError
from toolkit.compat.fairseq.weights import FAIRSEQ_IGNORED, to_toolkit_weights

logger = logging.getLogger("toolkit.checkpoint.fairseq_checkpoint")  # the logger name log lines and filters already use

DEFAULT_MAX_TARGET_POSITIONS = 1024  # fairseq's, for checkpoints that never set it


def read_checkpoint(path: str) -> Dict[str, Any]:
    """A toolkit or fairseq checkpoint: the toolkit's ``weights_only`` reader, fairseq's allowlist for the
    options objects fairseq pickles."""
    return consolidated.load_checkpoint_file(path, pickled_objects=fairseq_pickle.read)


def is_fairseq_checkpoint(state: Dict[str, Any]) -> bool:
    cfg = state.get("cfg")
    return (
        "optimizer_history" in state
        or state.get("args") is not None
        or (isinstance(cfg, dict) and isinstance(cfg.get("model"), dict))
    )


def fairseq_options(state: Dict[str, Any], path: str) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(model options, task options) by fairseq's names, from ``args`` (0.10) or ``cfg`` (later)."""
    if isinstance(state.get("args"), dict):
        args = dict(state["args"])
        return args, args
    cfg = state.get("cfg")
    if isinstance(cfg, dict) and isinstance(cfg.get("model"), dict):
        model = {k: _resolve(v, cfg) for k, v in cfg["model"].items()}
        task = {k: _resolve(v, cfg) for k, v in (cfg.get("task") or {}).items()}
        return model, task
    raise UserError(f"{path}: fairseq checkpoint without 'args' or 'cfg.model'; cannot tell its architecture")


def _resolve(value: Any, cfg: Dict[str, Any]) -> Any:
    """An unresolved omegaconf interpolation ``${task.tokens_per_sample}`` -> its value in ``cfg``."""
    if isinstance(value, str) and value.startswith("${") and value.endswith("}"):
        node: Any = cfg
        for part in value[2:-1].split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node
    return value


# fairseq option -> (is the feature on?, what it is). Refused unless our config has a field of that name.
_FEATURES = {
    "adaptive_softmax_cutoff": (lambda v, o: v not in (None, "", "None"), "adaptive softmax"),
    "adaptive_input": (lambda v, o: bool(v), "adaptive input embeddings"),
    "character_embeddings": (lambda v, o: bool(v), "character embeddings"),
    "tie_adaptive_weights": (lambda v, o: bool(v), "tied adaptive weights"),
    "cross_self_attention": (lambda v, o: bool(v), "cross+self attention"),
    "base_layers": (lambda v, o: (v or 0) > 0, "BASE layers"),
    "layernorm_embedding": (lambda v, o: bool(v), "LayerNorm on the embeddings"),
    "scale_fc": (lambda v, o: bool(v), "NormFormer FFN LayerNorm"),
    "scale_attn": (lambda v, o: bool(v), "NormFormer attention LayerNorm"),
    "scale_heads": (lambda v, o: bool(v), "NormFormer head scales"),
    "scale_resids": (lambda v, o: bool(v), "NormFormer residual scales"),
    "decoder_layers_to_keep": (lambda v, o: bool(v), "pruned LayerDrop layers"),
    "decoder_input_dim": (lambda v, o: v is not None and v != o.get("decoder_embed_dim"), "project_in_dim"),
    "decoder_output_dim": (lambda v, o: v is not None and v != o.get("decoder_embed_dim"), "project_out_dim"),
}


def toolkit_cfg(state: Dict[str, Any], path: str, model_config: type) -> Dict[str, Any]:
    """The flat option dict a toolkit checkpoint stores (``cfg``), for this fairseq checkpoint."""
    model, task = fairseq_options(state, path)
    ours = {f.name for f in dataclasses.fields(model_config)}
    for name, (active, what) in _FEATURES.items():
        if name not in ours and active(model.get(name), model):
            flag = "--" + name.replace("_", "-")
            raise UserError(
                f"{path}: cannot load: the fairseq model uses {flag} ({what}), "
                f"which toolkit's transformer_lm does not implement"
            )
    values = {name: model[name] for name in ours if model.get(name) is not None}
    values["decoder_normalize_before"] = bool(model.get("decoder_normalize_before", True))
    for name in ("decoder_input_dim", "decoder_output_dim"):  # absent: the width (fairseq 0.10's base_lm_architecture)
        values[name] = model.get(name)
    if not values.get("activation_dropout") and model.get("relu_dropout"):
        values["activation_dropout"] = model["relu_dropout"]  # fairseq's older name
    if "decoder_final_norm" in model:
        values["no_decoder_final_norm"] = not model["decoder_final_norm"]
    if "no_tie_adaptive_proj" in model or _decoder_version(state) <= 2:
        values["no_decoder_final_norm"] = True  # fairseq: such models have no final LayerNorm
    tokens_per_sample = task.get("tokens_per_sample") or model.get("tokens_per_sample")
    values["max_target_positions"] = (
        model.get("max_target_positions") or tokens_per_sample or DEFAULT_MAX_TARGET_POSITIONS
    )
    return {
        **values,
        "task": "language_modeling",
        "arch": "transformer_lm",
        "data": task.get("data"),
        "tokens_per_sample": tokens_per_sample or DEFAULT_MAX_TARGET_POSITIONS,
        "sample_break_mode": task.get("sample_break_mode") or "none",
        "add_bos_token": bool(task.get("add_bos_token", False)),
        "seed": model.get("seed", task.get("seed", 1)) or 1,
    }


def _decoder_version(state: Dict[str, Any]) -> float:
    version = state.get("model", {}).get("decoder.version")
    return float(version.flatten()[0]) if isinstance(version, torch.Tensor) and version.numel() else 1.0


def fold_adaptive_aliases(
    path: str, model: torch.nn.Module, weights: Dict[str, torch.Tensor]
) -> Dict[str, torch.Tensor]:
    """fairseq stores a tied adaptive weight under both modules' names (and buffers we do not keep);
    here it is one parameter, the adaptive input's: the aliases must equal their source and are dropped."""
    if getattr(model, "adaptive_softmax", None) is None and not any(
        k.startswith("embed_tokens.embeddings.") for k in weights
    ):
        return weights
    from toolkit.models.adaptive import from_fairseq_state_dict

    try:
        return from_fairseq_state_dict(weights, model, prefix="")
    except UserError as e:
        raise UserError(f"{path}: cannot load: {e}") from None


def check_weights(path: str, model: torch.nn.Module, weights: Dict[str, torch.Tensor], source: Dict[str, str]) -> None:
    """One line naming the first fairseq weight without a counterpart, of another shape, or missing."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    expected = get_model_state_dict(model)  # canonical names under any wrapper (DDP, FSDP2, checkpointing)
    model_fit.check_weights(
        f"{path}: cannot load",
        weights,
        expected,
        describe=lambda name: f"{name} (fairseq name {source.get(name, 'decoder.' + name)})",
        fix="the model is built from the checkpoint's own options: a fairseq feature "
        "toolkit's transformer_lm does not implement, or an incomplete checkpoint",
    )


def import_checkpoint(path: str, state: Dict[str, Any], model_config: type) -> Dict[str, Any]:
    """A fairseq checkpoint as a toolkit one: ``{"cfg": flat options, "model": our weights, ...}``."""
    if "fsdp_metadata" in state:
        raise UserError(
            f"{path}: one shard of a fairseq FSDP checkpoint (flattened parameters); load it with "
            f"fairseq's load_model_ensemble(num_shards=...) and save the consolidated model first"
        )
    cfg = toolkit_cfg(state, path, model_config)
    weights, source = to_toolkit_weights(
        state["model"],
        path,
        bool(cfg.get("share_decoder_input_output_embed")),
        drop_final_norm=_decoder_version(state) <= 2,
    )
    history = state.get("optimizer_history") or [{}]
    logger.info(
        f"{path}: fairseq checkpoint ({'args' if state.get('args') else 'cfg'} layout, "
        f"{history[-1].get('num_updates', 0)} updates)"
    )
    return {"cfg": cfg, "model": weights, "fairseq_source": source, "fairseq_state": state}


# ---- optimizer state (fairseq -> ours) ---------------------------------------------------------


def _fairseq_parameter_keys(state: Dict[str, Any], shared: bool) -> List[str]:
    """fairseq's ``model.parameters()`` order: its state dict's order without buffers and the tied copy."""
    keys = []
    for key in state["model"]:
        name = key[len("decoder.") :]
        if name in FAIRSEQ_IGNORED or (shared and name == "output_projection.weight"):
            continue
        keys.append(key)
    return keys


def _fairseq_moments(state: Dict[str, Any], keys: List[str]) -> Optional[Dict[str, Dict[str, Any]]]:
    """Per fairseq key: {"step", "exp_avg", "exp_avg_sq"}, from a per-parameter or a flat (FP16Optimizer) state."""
    saved = (state.get("last_optimizer_state") or {}).get("state")
    if not isinstance(saved, dict) or not saved:
        return None
    params = [state["model"][k] for k in keys]
    entries = list(saved.values())
    if not all(isinstance(e, dict) and {"exp_avg", "exp_avg_sq"} <= set(e) for e in entries):
        return None
    total = sum(p.numel() for p in params)
    if len(entries) == 1 and len(keys) > 1 and entries[0]["exp_avg"].numel() == total:  # one flat fp32 vector
        flat, out, offset = entries[0], {}, 0
        for key, p in zip(keys, params):
            out[key] = {
                m: flat[m].reshape(-1)[offset : offset + p.numel()].view_as(p).clone()
                for m in ("exp_avg", "exp_avg_sq")
            }
            out[key]["step"] = flat.get("step", 0)
            offset += p.numel()
        return out
    if sorted(saved) != list(range(len(keys))):
        return None
    out = {}
    for index, (key, p) in enumerate(zip(keys, params)):
        entry = saved[index]
        if entry["exp_avg"].shape != p.shape:
            return None
        out[key] = {"step": entry.get("step", 0)}
        for moment in ("exp_avg", "exp_avg_sq"):  # --fp16-adam-stats: fp16 values times a scale
            out[key][moment] = entry[moment].float() * float(entry.get(f"{moment}_scale", 1.0))
    return out


def map_optimizer_state(state: Dict[str, Any], shared: bool) -> Optional[Dict[str, Dict[str, torch.Tensor]]]:
    """fairseq Adam moments by our parameter names (q/k/v fused), or None when they do not map."""
    keys = _fairseq_parameter_keys(state, shared)
    moments = _fairseq_moments(state, keys)
    if moments is None:
        return None
    named: Dict[str, Dict[str, torch.Tensor]] = {}
    for moment in ("exp_avg", "exp_avg_sq"):
        mapped, _ = to_toolkit_weights(
            {k: moments[k][moment] for k in keys}, "", shared, drop_final_norm=_decoder_version(state) <= 2
        )
        for name, value in mapped.items():
            named.setdefault(name, {})[moment] = value.float()
    steps = {float(torch.as_tensor(m["step"]).item()) for m in moments.values()}
    step = torch.tensor(max(steps) if steps else 0.0)
    return {name: {"step": step.clone(), **value} for name, value in named.items()}


def _clean_name(name: str) -> str:
    for wrapper in ("module.", "_orig_mod.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def load_fairseq_into_trainer(
    path: str, trainer, reset_optimizer: bool = False, state: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """``--restore-file`` / ``--finetune-from-model`` with a fairseq checkpoint: weights, and Adam
    moments where they map (otherwise a fresh optimizer, said in one INFO line).

    Returns ``{"num_updates", "epoch"}`` as fairseq saved them (the caller decides whether a
    fine-tuning run keeps them).
    """
    from toolkit.checkpoint.dcp_state import set_model_state_dict, set_optimizer_state_dict

    from toolkit.core import registry
    from toolkit.checkpoint.consolidated import FULL_STATE

    state = read_checkpoint(path) if state is None else state
    if not is_fairseq_checkpoint(state):
        raise UserError(f"{path}: not a fairseq checkpoint")
    registry.import_all_components()
    imported = import_checkpoint(path, state, registry.resolve_arch("transformer_lm").config)
    shared = bool(imported["cfg"].get("share_decoder_input_output_embed"))
    weights = fold_adaptive_aliases(path, trainer.model, imported["model"])
    check_weights(path, trainer.model, weights, imported.get("fairseq_source", {}))
    set_model_state_dict(trainer.model, weights, options=FULL_STATE)
    moments = None if reset_optimizer else map_optimizer_state(state, shared)
    names = {id(p): _clean_name(n) for n, p in trainer.model.named_parameters()}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in trainer.optimizer.param_groups
    ]
    wanted = {n for g in groups for n in g["params"]}
    if moments is not None and set(moments) == wanted:
        set_optimizer_state_dict(
            trainer.model, trainer.optimizer, {"state": moments, "param_groups": groups}, options=FULL_STATE
        )
        logger.info(f"{path}: fairseq Adam moments loaded ({len(moments)} parameters)")
    elif not reset_optimizer:
        logger.info(f"{path}: fairseq optimizer state does not map onto this optimizer; starting a fresh one")
    history = state.get("optimizer_history") or [{}]
    iterator = (state.get("extra_state") or {}).get("train_iterator") or {}
    return {"num_updates": int(history[-1].get("num_updates", 0)), "epoch": int(iterator.get("epoch", 1))}
