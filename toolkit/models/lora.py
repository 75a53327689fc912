"""LoRA: low-rank adapters beside a model's frozen Linear layers, applied from outside the model.

``--lora-rank r`` turns each targeted ``nn.Linear`` of the blocks (``--lora-targets``: the layers' last names,
comma separated, or ``all-linear``, the default: every Linear of the blocks, the output head left out, as peft's
``all-linear``) into a :class:`LoRALinear`: the same module path and the same ``weight``/``bias`` parameters, plus
``lora_A`` [r, in] and ``lora_B`` [out, r] (peft's names and layout), computing

    y = x W^T + b + (alpha / r) * B(A(dropout(x)))

(``--lora-alpha``, ``--lora-dropout``: peft's ``lora_alpha`` and ``lora_dropout``). Every other parameter is frozen (``requires_grad`` off) and keeps its dtype; the optimizer, the gradient
norm and the log's ``num. trained`` see only the adapters. ``lora_A`` starts as peft's (Kaiming-uniform, a
bound of 1/sqrt(in)), ``lora_B`` at zero, so the first forward is the base model's; the values come from
``init_weights``' per-name generators (:meth:`LoRALinear.initial_values`), the same on any layout.

The swap is the first step of the parallelize sequence (``toolkit/distributed/parallelize.py``), on the
meta-device model, so tensor parallelism (the adapters split as the layer they adapt:
``tensor_parallel.ADAPTER_SPLIT``), activation checkpointing, ``--compile`` and FSDP2 wrap the adapted blocks as any other, and checkpoints hold the adapters under their
own names (``layers.0.self_attn.q_proj.lora_A.weight``) beside the base weights: a resume is exact. A
fine-tuning start keeps a checkpoint's adapters, merges them into a run without adapters, or starts fresh ones
(:func:`finetune_start`).
``merged_state`` folds them into the base weights (``toolkit-export --format hf``, evaluation);
``detach_adapters`` gives the base model back with its adapters beside it (``--format peft``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.core.errors import UserError
from toolkit.models.init import canonical_name

ALL_LINEAR = "all-linear"
ADAPTER_PARTS = ("lora_A", "lora_B")


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a low-rank update (module docstring); its own ``weight``/``bias`` are the base's."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        factory = {"device": base.weight.device, "dtype": torch.float32}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **factory)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **factory)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        update = self.lora_B(self.lora_A(self.lora_dropout(x)))
        return base + update.to(base.dtype) * self.scaling

    def initial_values(self) -> Dict[str, callable]:
        """``{local parameter: fn(shape, generator) -> full fp32 value}`` for ``init_weights``: peft's start."""
        bound = 1.0 / math.sqrt(self.in_features)
        return {
            "lora_A.weight": lambda shape, generator: torch.empty(shape).uniform_(-bound, bound, generator=generator),
            "lora_B.weight": lambda shape, generator: torch.zeros(shape),
        }

    def merged_weight(self) -> torch.Tensor:
        """``W + (alpha / r) B A`` in fp32 (full tensors: call on an unsharded model)."""
        delta = self.lora_B.weight.float() @ self.lora_A.weight.float()
        return self.weight.float() + self.scaling * delta

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora rank={self.rank}, alpha={self.alpha}"


def target_names(targets: str) -> Optional[List[str]]:
    """The leaf names of ``--lora-targets`` (None: ``all-linear``)."""
    if targets.strip() == ALL_LINEAR:
        return None
    names = [t.strip() for t in targets.split(",") if t.strip()]
    if not names:
        raise UserError(
            f"--lora-targets {targets!r}: give the last names of the blocks' Linear layers (comma separated), "
            f"or {ALL_LINEAR}"
        )
    return names


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float, targets: str) -> List[str]:
    """Swap the targeted Linear layers of ``model.layers`` for :class:`LoRALinear` and freeze the rest; returns
    the adapted modules' names (relative to the model)."""
    wanted = target_names(targets)
    blocks = model.layers  # a model without them is refused by the parallelize sequence's check_blocks
    linears = [(name, m) for name, m in blocks.named_modules() if type(m) is nn.Linear]
    chosen = [(name, m) for name, m in linears if wanted is None or name.rsplit(".", 1)[-1] in wanted]
    if not chosen:
        found = sorted({name.rsplit(".", 1)[-1] for name, _ in linears})
        raise UserError(
            f"--lora-targets {targets}: no Linear layer of the blocks has that name (they are "
            f"{', '.join(found) or 'none'}); give some of those, or {ALL_LINEAR}"
        )
    if wanted is not None:
        unmatched = sorted(set(wanted) - {name.rsplit(".", 1)[-1] for name, _ in chosen})
        if unmatched:
            raise UserError(
                f"--lora-targets {targets}: {', '.join(unmatched)} names no Linear layer of the blocks (they are "
                f"{', '.join(sorted({n.rsplit('.', 1)[-1] for n, _ in linears}))})"
            )
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module in chosen:
        parent_name, _, leaf = name.rpartition(".")
        parent = blocks.get_submodule(parent_name) if parent_name else blocks
        setattr(parent, leaf, LoRALinear(module, rank, alpha, dropout))
    return [f"layers.{name}" for name, _ in chosen]


def adapted_modules(model: nn.Module) -> List[Tuple[str, LoRALinear]]:
    return [(canonical_name(name), m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def is_adapter(name: str) -> bool:
    return any(f".{part}." in f".{name}" for part in ADAPTER_PARTS)


def adapter_modules(state: Dict[str, torch.Tensor]) -> List[str]:
    """The modules a state's adapters adapt (``layers.0.self_attn.q_proj``)."""
    return sorted(name[: -len(".lora_A.weight")] for name in state if name.endswith(".lora_A.weight"))


def finetune_start(model: nn.Module, state: Dict[str, torch.Tensor], saved_cfg: Dict, path: str):
    """The weights a fine-tuning start (``--finetune-from-model path``) loads into ``model``, and a line saying
    what became of the adapters (None: neither side has any).

    A checkpoint with adapters (a LoRA run, ``--from peft``) into a run without ``--lora-rank``: merged into the
    weights they adapt (``W + (alpha / r) B A`` at the checkpoint's scale), the run trains the whole model. Into a
    run with ``--lora-rank``: kept, so the adapters continue; the run's rank and adapted layers must be the
    checkpoint's. A checkpoint without adapters into a LoRA run keeps the run's fresh ones. The model's own
    entries come as ``get_model_state_dict`` gives them (DTensors under FSDP2, which the full-state load keeps)."""
    ours, theirs = sorted(name for name, _ in adapted_modules(model)), adapter_modules(state)
    if not theirs:
        if not ours:
            return state, None
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        own = get_model_state_dict(model)
        return {**{k: v for k, v in own.items() if is_adapter(k)}, **state}, "fresh LoRA adapters"
    saved = SavedLoRA.of(saved_cfg)
    if not ours:
        if not saved.rank:
            raise UserError(f"--finetune-from-model {path}: holds LoRA adapters but no --lora-rank in its options")
        merged = merged_state(state, saved.scaling)
        return merged, f"merged its {len(theirs)} LoRA adapters (r {saved.rank}) into the weights they adapt"
    rank = dict(adapted_modules(model))[ours[0]].rank
    if ours != theirs or state[f"{theirs[0]}.lora_A.weight"].shape[0] != rank:
        raise UserError(
            f"--finetune-from-model {path}: its adapters (r {saved.rank}, --lora-targets {saved.targets}) are not "
            f"this run's (r {rank}, {len(ours)} layers); give its --lora-rank and --lora-targets to continue them, "
            f"or no --lora-rank to merge them and train the whole model"
        )
    return state, f"continues its {len(theirs)} LoRA adapters"


@dataclass(frozen=True)
class SavedLoRA:
    """A checkpoint's ``--lora-*`` options (its ``cfg``); ``rank`` 0: trained without adapters."""

    rank: int
    alpha: float
    dropout: float
    targets: str

    @classmethod
    def of(cls, cfg: Dict) -> SavedLoRA:
        return cls(
            int(cfg.get("lora_rank") or 0),
            float(cfg.get("lora_alpha", 8.0)),
            float(cfg.get("lora_dropout", 0.0)),
            str(cfg.get("lora_targets", ALL_LINEAR)),
        )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def detach_adapters(model: nn.Module) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """Turn each :class:`LoRALinear` of ``model`` back into the ``nn.Linear`` it adapts (the same weight and bias
    tensors), leaving the base model; returns ``{module name: (lora_A weight, lora_B weight)}``."""
    adapters = {}
    for name, module in adapted_modules(model):
        base = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        base.weight, base.bias = module.weight, module.bias
        adapters[name] = (module.lora_A.weight.detach(), module.lora_B.weight.detach())
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, base)
    return adapters


def merged_state(state: Dict[str, torch.Tensor], scaling: float) -> Dict[str, torch.Tensor]:
    """A full state with each adapted weight merged (``W + scaling * B A``) and the adapters dropped."""
    merged = {k: v for k, v in state.items() if not is_adapter(k)}
    for name in state:
        if name.endswith(".lora_A.weight"):
            module = name[: -len(".lora_A.weight")]
            delta = state[f"{module}.lora_B.weight"].float() @ state[name].float()
            weight = merged[f"{module}.weight"]
            merged[f"{module}.weight"] = (weight.float() + scaling * delta).to(weight.dtype)
    return merged
