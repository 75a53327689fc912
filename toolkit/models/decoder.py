"""What every decoder-only language model gives the trainer, eval-lm, generation and the hub.

A family's model class (``transformer_lm``, ``llama``) inherits :class:`DecoderInterface` and
provides ``__init__(cfg, vocab_size, padding_idx)``, ``forward(tokens, incremental_state=None)``,
``layers`` (its blocks, wrapped from outside by FSDP2, activation checkpointing and ``--compile``),
``max_target_positions``, ``initial_value`` / ``reset_buffers`` (``toolkit.models.init``) and
``flops_per_token``. The shared parts live here once:

- ``build_model(cfg, task)``: the context length defaults to the task's (``--tokens-per-sample``);
- ``from_pretrained``: the hub interface (encode/decode/score/sample), as fairseq's;
- the incremental state of generation: ``{"positions": n, "layers": [KVCache per block]}``, and
  beam search's ``reorder_incremental_state``.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch

from toolkit.core import registry
from toolkit.core.dtensor import is_dtensor
from toolkit.core.protocols import Bounded
from toolkit.models.common.attention.cache import KVCache  # the layers' caches (a layout of each attention variant)
from toolkit.models.fused_loss import LossTarget, linear_cross_entropy, matmul_dtype
from toolkit.models.outputs import with_summed_nll


class DecoderInterface:
    layers: torch.nn.ModuleList
    max_target_positions: int
    # What the parallel layout may place on this family (toolkit.core.protocols.ContextParallelizable,
    # ExpertParallelizable): a family with context-parallel attention or MoE layers sets its flag to True.
    supports_context_parallel: bool = False
    supports_expert_parallel: bool = False
    # forward(..., loss_target=LossTarget) may return the summed NLL instead of logits (fused_head_loss)
    supports_fused_loss: bool = False

    @classmethod
    def build_model(cls, cfg, task):
        """The family's hook that ``toolkit.models.build_model`` calls with the resolved options (fairseq's
        ``Model.build_model(args, task)``, which plugins may override): the context length defaults to the task's."""
        if cfg.max_target_positions is None:
            task_max = task.max_positions() if isinstance(task, Bounded) else None
            cfg = dataclasses.replace(cfg, max_target_positions=task_max or task.cfg.tokens_per_sample)
        return cls(cfg, len(task.dictionary), task.dictionary.pad())

    @classmethod
    def from_pretrained(
        cls, model_name_or_path: str, checkpoint_file: Optional[str] = None, data_name_or_path: str = ".", **kwargs
    ):
        """A trained model behind a hub interface (encode/decode/score/sample), as fairseq's."""
        return registry.hub_from_pretrained(model_name_or_path, checkpoint_file, data_name_or_path, **kwargs)

    def max_positions(self) -> int:
        return self.max_target_positions

    def _first_position(self, tokens: torch.Tensor, incremental_state: Optional[Dict]) -> int:
        """Position of ``tokens``' first column: 0, or the number already cached; checks the context length."""
        start = 0 if incremental_state is None else incremental_state.get("positions", 0)
        if start + tokens.size(1) > self.max_target_positions:
            raise ValueError(
                f"input of {start + tokens.size(1)} tokens is longer than max_target_positions "
                f"({self.max_target_positions})"
            )
        return start

    def _layer_caches(self, incremental_state: Optional[Dict]) -> List[Optional[KVCache]]:
        if incremental_state is None:
            return [None] * len(self.layers)
        return incremental_state.setdefault("layers", [KVCache() for _ in self.layers])

    def fused_head_loss(self, hidden: torch.Tensor, weight: torch.Tensor, loss_target: Optional[LossTarget]):
        """``(None, {"summed_nll": ...})`` of the head ``hidden @ weight.T`` and the cross-entropy fused
        (``toolkit.models.outputs.with_summed_nll``), or None where the caller must compute logits: no target
        asked for, a weight split over ranks (tensor parallel: a DTensor here, whose softmax needs the whole
        vocabulary row; under FSDP2 the root's weights are whole plain tensors during forward and fuse), or an
        fp16 matmul (the loss scale comes after the fused gradient, see ``toolkit.models.fused_loss``)."""
        if (
            loss_target is None
            or is_dtensor(weight)
            or is_dtensor(hidden)
            or matmul_dtype(hidden, weight) == torch.float16
        ):
            return None
        return with_summed_nll(
            linear_cross_entropy(hidden, weight, loss_target.target, loss_target.ignore_index, loss_target.chunk_rows)
        )

    def reorder_incremental_state(self, incremental_state: Dict, new_order: torch.Tensor) -> None:
        """Keep (and repeat) the cached rows ``new_order``: beam search's reordering, finished rows leaving."""
        for cache in incremental_state.get("layers", []):
            cache.reorder(new_order)


def roles_by_prefix(model: torch.nn.Module, embeddings: tuple, outputs: tuple) -> Dict[str, str]:
    """A decoder family's parameter roles (``toolkit.core.protocols.ParameterRoles``) from what the family
    declares: the module prefixes that are lookup tables (``embeddings``) and the output head (``outputs``).
    Everything else follows from the module that owns the parameter: a bias is a ``bias``, the weight of a
    normalization (1-D) is a ``norm``, a 2-D weight in the blocks is a ``matrix``, and so is a 3-D stack of
    experts' weights (Muon orthogonalizes each expert's matrix)."""
    roles: Dict[str, str] = {}
    for name, p in model.named_parameters():
        if name.startswith(embeddings):
            roles[name] = "embedding"
        elif name.startswith(outputs):
            roles[name] = "output"
        elif name.endswith(".bias"):
            roles[name] = "bias"
        elif p.dim() == 1:
            roles[name] = "norm"
        elif p.dim() == 2 or p.dim() == 3:  # a weight, or a MoE layer's stack of experts' weights
            roles[name] = "matrix"
        else:
            raise ValueError(f"{type(model).__name__}: no role for parameter {name} of shape {tuple(p.shape)}")
    return roles
