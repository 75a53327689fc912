"""A saved model's options read as the family that builds them, where they hold the Llama family's norm switches.

A checkpoint stores its ``--arch`` and every model option (``cfg``; also a sharded checkpoint's ``meta.pt``
and a ``--format safetensors`` folder's ``config.json``). Options of the Llama and MoE families that name
``gemma_norms`` or ``norm_after_sublayer`` describe a model of another family: Gemma's (1 + w) norms before and
after each sublayer are the ``gemma3`` family, norms after the sublayers the ``olmo2`` family, and the Llama
and MoE families build neither. :func:`as_family` turns such options into that family's: its name as the
``--arch`` where the saved arch belongs to another family (a named size of the right family stays), and the
options the family does not have left out when their values compute what it builds (``NEUTRAL``, ``BUILT_IN``);
a value that would compute something no family builds is refused in one line naming the option. The model's tensors keep their
names, so the weights and optimizer state load as they were saved.

The readers of saved options call it (``toolkit.checkpoint.consolidated``, ``toolkit.checkpoint.sharded``,
``toolkit.inference.safetensors_read``); everything above them sees the family's options.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

from toolkit.core import registry
from toolkit.core.errors import UserError

SWITCHES = {"gemma_norms": "gemma3", "norm_after_sublayer": "olmo2"}
"""An option that, true, makes the options another family's (checked in this order: Gemma's norms first)."""
NEUTRAL: Dict[str, Any] = {
    "gemma_norms": False,
    "norm_after_sublayer": False,
    "qk_norm_over": "head",
    "query_pre_attn_scalar": None,
    "rope_local_theta": None,
    "attn_logit_softcap": None,
    "final_logit_softcap": None,
}
"""Options a family may lack, and the value with which such an option changes nothing in a family without it."""
BUILT_IN: Dict[str, Dict[str, Any]] = {"gemma3": {"gemma_norms": True}, "olmo2": {"norm_after_sublayer": True}}
"""What a family is by construction: its switch holds this value in every model of it."""
SPLIT_FAMILIES = ("llama", "moe", "gemma3", "olmo2")


def _as_built(name: str, cfg: Dict[str, Any], family: str) -> bool:
    """Whether option ``name`` of ``cfg`` computes what ``family``, which has no such option, builds."""
    if name == "qk_norm_over" and not cfg.get("qk_norm"):
        return True  # where the QK-norm spans says nothing without one
    return cfg[name] == BUILT_IN.get(family, {}).get(name, NEUTRAL[name])


def as_family(cfg: Any, where: str) -> Any:
    """``cfg`` (a checkpoint's saved options, a dict) as the options of the family that builds its model (see the
    module docstring); anything else, and options already a family's own, as they are."""
    if not isinstance(cfg, dict) or not any(name in cfg for name in SWITCHES):
        return cfg
    registry.declare_builtin_components()  # the named sizes and each family's options, without torch
    arch = cfg.get("arch")
    family = registry.ARCH_MODEL_NAME.get(arch, arch)
    if family not in SPLIT_FAMILIES:
        return cfg
    target = next((SWITCHES[name] for name in SWITCHES if cfg.get(name)), family)
    if family == "moe" and target != "moe":
        raise UserError(
            f"{where}: --arch {arch} with --{next(n for n in SWITCHES if cfg.get(n)).replace('_', '-')}: no "
            "family builds these norms around a mixture of experts; load it with the toolkit version that saved it"
        )
    own = {f.name for f in dataclasses.fields(registry.resolve_arch(target).config)}
    computing = [name for name in NEUTRAL if name in cfg and name not in own and not _as_built(name, cfg, target)]
    if computing:
        values = ", ".join(f"--{name.replace('_', '-')} {cfg[name]}" for name in computing)
        raise UserError(
            f"{where}: {values}: the {target} family has no such option and no family builds this model; "
            "load it with the toolkit version that saved it"
        )
    out = {name: value for name, value in cfg.items() if name not in NEUTRAL or name in own}
    if target != family:
        out["arch"] = target
    return out
