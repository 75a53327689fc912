"""``--decoder-layers-to-keep`` added to a run whose checkpoint has every layer: the checkpoint loads pruned.

fairseq's LayerDrop README: a model trained with ``--decoder-layerdrop`` is pruned by adding
``--decoder-layers-to-keep 0,2,...``; the full checkpoint loads into the smaller model, kept
layers renumbered (:func:`toolkit.models.layerdrop.prune_state_dict`, which logs fairseq's
``Pruning model to specified layer configuration`` line). On a resume the optimizer's
per-parameter state is pruned the same way, so training goes on with the kept layers' moments.
"""

from __future__ import annotations

from typing import Any, Dict, List

from toolkit.models.layerdrop import parse_layers_to_keep, prune_state_dict


def prune_checkpoint(checkpoint: Dict[str, Any], model_cfg: Any) -> Dict[str, Any]:
    """``checkpoint`` (a consolidated one: model, optimizer state, cfg) for the model ``--decoder-layers-to-keep``
    builds; unchanged when the flag is not given or the checkpoint already has that many layers."""
    keep = parse_layers_to_keep(getattr(model_cfg, "decoder_layers_to_keep", None))
    if keep is None:
        return checkpoint
    model = prune_state_dict(checkpoint["model"], keep, len(keep))
    if model is checkpoint["model"]:
        return checkpoint
    out = dict(checkpoint, model=model)
    # The checkpoint now holds the pruned model: its saved flag says so (the resume check compares flags).
    out["cfg"] = dict(checkpoint.get("cfg", {}), decoder_layers_to_keep=model_cfg.decoder_layers_to_keep)
    optimizer = checkpoint.get("last_optimizer_state")
    if optimizer is not None:
        out["last_optimizer_state"] = _prune_optimizer_state(optimizer, keep)
    return out


def _prune_optimizer_state(optimizer: Dict[str, Any], keep: List[int]) -> Dict[str, Any]:
    """A full optimizer state dict keyed by parameter names (``get_optimizer_state_dict``), pruned as the model."""
    state = prune_state_dict(optimizer.get("state", {}), keep, len(keep), log=False)
    groups = []
    for group in optimizer.get("param_groups", []):
        names = prune_state_dict({name: None for name in group.get("params", [])}, keep, len(keep), log=False)
        groups.append(dict(group, params=list(names)))
    return dict(optimizer, state=state, param_groups=groups)
