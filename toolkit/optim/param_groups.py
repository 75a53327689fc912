"""The optimizer's parameter groups from the family's parameter roles (``toolkit.core.protocols.ParameterRoles``).

Two things need to know what a parameter is, and neither may guess from its name or shape: Muon
(``--optimizer muon``) orthogonalizes the blocks' matrices and leaves embeddings, the output head, norms and
biases to AdamW; ``--weight-decay`` skips norms, biases and embeddings under
``--no-decay-norms-biases-embeddings``. The family says what each parameter is; this module turns that into
torch parameter groups, one per role, each tagged ``"role"`` (and ``"weight_decay": 0.0`` where it is not
decayed). A run that needs neither keeps the single flat list, so fairseq's optimizer state layout (one group)
is unchanged.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List

import torch

from toolkit.core.errors import UserError
from toolkit.core.protocols import PARAMETER_ROLES, ParameterRoles

logger = logging.getLogger("toolkit.optim")

NO_DECAY_ROLES = ("norm", "bias", "embedding")


def _declaring_model(model: torch.nn.Module) -> torch.nn.Module:
    """The family's module itself: DDP wraps it (its parameter names gain ``module.``)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def skips_decay(model: torch.nn.Module, no_decay: bool, decay_all: bool) -> bool:
    """Whether ``--weight-decay`` skips norms, biases and embeddings: the flags, else the family's default."""
    if no_decay and decay_all:
        raise UserError("--no-decay-norms-biases-embeddings and --decay-all-parameters contradict each other; "
                        "pass one of them")
    if no_decay or decay_all:
        return no_decay
    return bool(getattr(type(_declaring_model(model)), "no_decay_norms_biases_embeddings_by_default", False))


def parameter_roles(model: torch.nn.Module, purpose: str) -> Dict[str, str]:
    """``{parameter name: role}`` as the family declares it; ``purpose`` names the flag that needs it."""
    inner = _declaring_model(model)
    if not isinstance(inner, ParameterRoles):
        raise UserError(f"{purpose}: the model {type(inner).__name__} does not declare its parameter roles "
                        f"(a parameter_roles() method, toolkit.core.protocols.ParameterRoles), so which parameters "
                        f"are matrices, embeddings, norms or biases is unknown; use --optimizer adam")
    roles = inner.parameter_roles()
    unknown = sorted({r for r in roles.values() if r not in PARAMETER_ROLES})
    if unknown:
        raise ValueError(f"{type(inner).__name__}.parameter_roles: unknown roles {unknown}; "
                         f"the roles are {PARAMETER_ROLES}")
    return roles


def parameter_groups(model: torch.nn.Module, by_role: bool, no_decay: bool, purpose: str) -> List[Any]:
    """The trainable parameters as the optimizer receives them: a flat list, or groups by role when the optimizer
    asks for roles (``by_role``) or norms, biases and embeddings are not decayed (``no_decay``)."""
    inner = _declaring_model(model)
    trainable = [(n, p) for n, p in inner.named_parameters() if p.requires_grad]
    if not (by_role or no_decay):
        return [p for _, p in trainable]
    roles = parameter_roles(model, purpose)
    groups: Dict[str, Dict[str, Any]] = {}
    for name, p in trainable:
        if name not in roles:
            raise ValueError(f"{type(inner).__name__}.parameter_roles: no role for parameter {name}")
        group = groups.setdefault(roles[name], {"params": [], "role": roles[name]})
        group["params"].append(p)
    ordered = [groups[r] for r in PARAMETER_ROLES if r in groups]
    if no_decay:
        for group in ordered:
            if group["role"] in NO_DECAY_ROLES:
                group["weight_decay"] = 0.0
    return ordered


def log_decay_choice(model: torch.nn.Module, no_decay: bool, explicit: bool, weight_decay: float) -> None:
    """One INFO line where the family's default (not a flag) decided to skip decay on some roles."""
    if no_decay and not explicit and weight_decay > 0:
        logger.info(f"--weight-decay {weight_decay}: not applied to norms, biases and embeddings "
                    f"({type(_declaring_model(model)).__name__}'s default; --decay-all-parameters to decay them)")
