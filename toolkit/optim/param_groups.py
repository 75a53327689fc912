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
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

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
        raise UserError(
            "--no-decay-norms-biases-embeddings and --decay-all-parameters contradict each other; pass one of them"
        )
    if no_decay or decay_all:
        return no_decay
    return bool(getattr(type(_declaring_model(model)), "no_decay_norms_biases_embeddings_by_default", False))


@dataclass(frozen=True)
class DecayChoice:
    """The flags that decide the optimizer's weight-decay groups, kept to compare a resume with its checkpoint.

    torch's ``load_state_dict`` matches parameter groups by position and restores each group's weight decay:
    a checkpoint whose groups skipped decay on norms, biases and embeddings does not fit a run that decays every
    parameter alike (a flat list, or role groups without the 0.0), and the other way round."""

    no_decay: bool  # --no-decay-norms-biases-embeddings
    decay_all: bool  # --decay-all-parameters
    weight_decay: float  # --weight-decay: at 0 nothing is decayed, so no group is set apart

    @classmethod
    def from_saved(cls, cfg: Any) -> Optional[DecayChoice]:
        """A checkpoint's choice from its ``cfg``; None for one saved before the flags existed."""
        if not isinstance(cfg, Mapping) or "no_decay_norms_biases_embeddings" not in cfg:
            return None
        return cls(
            bool(cfg["no_decay_norms_biases_embeddings"]),
            bool(cfg.get("decay_all_parameters")),
            float(cfg.get("weight_decay") or 0.0),
        )

    def skips(self, model: torch.nn.Module) -> bool:
        """Whether the groups set norms, biases and embeddings apart (``parameter_groups``'s ``no_decay``)."""
        return skips_decay(model, self.no_decay, self.decay_all) and self.weight_decay > 0

    def because(self, model: torch.nn.Module) -> str:
        if self.weight_decay <= 0:
            return f"--weight-decay {self.weight_decay:g}"
        if self.no_decay or self.decay_all:
            return "--no-decay-norms-biases-embeddings" if self.no_decay else "--decay-all-parameters"
        return f"{type(_declaring_model(model)).__name__}'s default"


def check_resumed_decay_groups(
    where: str, saved: Optional[DecayChoice], now: DecayChoice, model: torch.nn.Module
) -> None:
    """A one-line refusal when this run's weight-decay groups are not the checkpoint's (``DecayChoice``)."""
    if saved is None or saved.skips(model) == now.skips(model):
        return
    if saved.skips(model):
        raise UserError(
            f"{where}: its optimizer state skips weight decay on norms, biases and embeddings (their "
            f"own parameter groups) but this run does not ({now.because(model)}), so the groups do not "
            f"match; resume with --no-decay-norms-biases-embeddings --weight-decay "
            f"{saved.weight_decay:g} as saved, or add --reset-optimizer"
        )
    raise UserError(
        f"{where}: its optimizer state treats every parameter alike for weight decay "
        f"({saved.because(model)}) but this run skips norms, biases and embeddings in their own "
        f"parameter groups ({now.because(model)}), so the groups do not match; resume with "
        f"{'--weight-decay 0' if saved.weight_decay <= 0 else '--decay-all-parameters'} as saved, "
        f"or add --reset-optimizer"
    )


def parameter_roles(model: torch.nn.Module, purpose: str) -> Dict[str, str]:
    """``{parameter name: role}`` as the family declares it; ``purpose`` names the flag that needs it."""
    inner = _declaring_model(model)
    if not isinstance(inner, ParameterRoles):
        raise UserError(
            f"{purpose}: the model {type(inner).__name__} does not declare its parameter roles "
            f"(a parameter_roles() method, toolkit.core.protocols.ParameterRoles), so which parameters "
            f"are matrices, embeddings, norms or biases is unknown; use --optimizer adam"
        )
    roles = inner.parameter_roles()
    unknown = sorted({r for r in roles.values() if r not in PARAMETER_ROLES})
    if unknown:
        raise ValueError(
            f"{type(inner).__name__}.parameter_roles: unknown roles {unknown}; the roles are {PARAMETER_ROLES}"
        )
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
        logger.info(
            f"--weight-decay {weight_decay}: not applied to norms, biases and embeddings "
            f"({type(_declaring_model(model)).__name__}'s default; --decay-all-parameters to decay them)"
        )
