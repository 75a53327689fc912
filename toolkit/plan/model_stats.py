"""What the planner needs from the model, read from the model itself built on the meta device.

Why the model and not a formula: the two families differ (LayerNorm + GELU + fused q/k/v against
RMSNorm + SwiGLU + grouped k/v heads), fairseq options change shapes (``--decoder-input-dim``,
adaptive softmax, untied output), and a user's ``--user-dir`` model is neither. So:

* parameters: every tensor's shape, whether tensor parallelism splits it (read from the family's own
  plan, ``tensor_parallel_plan()``, through the kinds ``toolkit.distributed.tensor_parallel`` applies:
  the planner names no module of any family), whether it is a position table (never in a matmul;
  ``PositionTables``), and which block of ``model.layers`` owns it;
* FLOPs per token: the model's own ``flops_per_token`` (what the MFU log uses; 6N for a model without it);
* activations: one forward plus the criterion's loss of a 1-layer and a 2-layer copy on the meta
  device (no memory, no compute), counting what autograd saves for backward (unique storages,
  parameters excluded). Their difference is one layer's bytes, the rest is the embeddings, the
  final norm, the logits and the loss. Attention is counted as a fused kernel saves it (q, k, v,
  output and the per-row log-sum-exp: flash attention on GPU, torch's flash kernel on CPU), not
  as the meta device's math fallback that would save the T x T scores.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F

from toolkit.core.errors import UserError
from toolkit.core.protocols import FlopsCounted, MetaTraceable, ParameterRoles, PositionTables


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: Tuple[int, ...]
    tp_split: bool  # split over the tensor-parallel ranks (along dim 0)
    layer: Optional[int]  # the decoder layer holding it (None: embeddings, final norm, output layer)
    matmul: bool = True  # a weight some matmul reads (autocast casts it): 2-D and not a position table
    role: str = ""  # the family's parameter_roles() ('matrix' takes Muon's update); "" when undeclared
    expert: bool = False  # a stack of MoE experts [E, ...]: split over --expert-parallel-size along dim 0

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Activations:
    """Bytes autograd keeps for backward, per sequence of ``tokens_per_sample`` tokens."""

    per_layer: int  # one decoder layer
    rest: int  # embeddings, final norm, logits and loss
    block_input: int  # one layer's input: all a checkpointed layer keeps


@dataclass(frozen=True)
class SplitLimits:
    """What the model allows each parallel axis, read from the model (what toolkit-train's workers check):
    ``tp_divisible``: (flag, size) pairs a tensor-parallel size must divide (heads, widths; the context length
    under sequence parallelism); ``tp_refused``: toolkit-train's one-line refusal of a tensor-parallel split of it
    (None: it takes one); ``context_parallel`` / ``expert_parallel`` / ``pipeline_parallel``: toolkit-train takes
    that split of it;
    ``experts``: a MoE layer's experts (what --expert-parallel-size must divide; 0 without MoE)."""

    tp_divisible: Tuple[Tuple[str, int], ...] = ()
    tp_refused: Optional[str] = "the model has no tensor-parallel plan"
    context_parallel: bool = False
    expert_parallel: bool = False
    pipeline_parallel: bool = False
    experts: int = 0


@dataclass(frozen=True)
class ModelStats:
    arch: str
    params: Tuple[ParamInfo, ...]
    num_layers: int
    embed_dim: int
    vocab_size: int
    tokens_per_sample: int
    flops_per_token: float
    activations: Activations
    kv_width: int = 0  # features per token a layer's attention keeps (k + v), summed over the layers
    expanded_kv_width: int = 0  # the same as expanded keys and values (more than kv_width for latent attention)
    active_params: Optional[int] = None  # parameters one token uses (MoE: its k experts a layer); None: all
    moe_top_k: int = 0  # experts a token goes through in each MoE layer (0: no MoE layer)
    moe_layers: int = 0  # layers whose feed-forward is a mixture of experts
    attention_layers: int = 0  # layers whose attention caches keys and values (kv_width sums over them)
    recurrent_layers: int = 0  # gated DeltaNet layers: a recurrent state per sequence instead of keys and values
    recurrent_state: int = 0  # numbers of their delta rules' states (Hv x Dk x Dv each, kept in fp32), summed
    recurrent_conv: int = 0  # numbers of their convolutions' last K-1 inputs (K-1 x channels each), summed
    splits: SplitLimits = SplitLimits()  # which parallel sizes the model itself takes (the layout search's pruning)

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)

    @functools.cached_property
    def memo(self) -> Dict[Tuple[Any, ...], int]:
        """Sums over the parameters the planner has made for this model, by what they depend on
        (:func:`toolkit.plan.memory.local_numel`): the layout search prices many layouts of one model."""
        return {}

    @functools.cached_property
    def param_groups(self) -> Tuple[Tuple[ParamInfo, int], ...]:
        """The parameters as (one of them, how many) per kind: equal shape, split and role, and the same place
        (the root, block 0, the top block, or another block). Every count the planner makes is a sum over
        parameters of a function of these, so it sums over tens of kinds instead of a model's thousand tensors
        (the layout search prices thousands of layouts)."""
        top = self.num_layers - 1
        groups: Dict[Tuple[Any, ...], List[Any]] = {}
        for p in self.params:
            place = p.layer if p.layer in (None, 0, top) else "block"
            key = (p.shape, p.tp_split, p.matmul, p.role, p.expert, place)
            groups.setdefault(key, [p, 0])[1] += 1
        return tuple((p, n) for p, n in groups.values())


class _CountingDictionary:
    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def pad(self) -> int:
        return 1


def vocab_size_of(cfg: Any) -> int:
    """The dictionary of ``cfg.task.data`` (its first data-bin) when given, else the arch's published one."""
    data = (getattr(cfg.task, "data", "") or "").split(os.pathsep)[0]
    if data and os.path.isfile(os.path.join(data, "dict.txt")):
        from toolkit.data.dictionary import Dictionary

        return len(Dictionary.load(os.path.join(data, "dict.txt")))
    from toolkit.models.accounting import default_vocab_size

    return default_vocab_size(cfg.components.arch)


def _build(arch: str, model_cfg: Any, vocab: int, tokens: int) -> torch.nn.Module:
    from toolkit import models

    task = SimpleNamespace(dictionary=_CountingDictionary(vocab), cfg=SimpleNamespace(tokens_per_sample=tokens))
    with torch.device("meta"):
        return models.build_model(arch, model_cfg, task)


def _layer_of(name: str) -> Optional[int]:
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
        return int(parts[1])
    return None


def param_infos(model: torch.nn.Module, with_roles: bool = False) -> Tuple[ParamInfo, ...]:
    """Every parameter once (tied ones under their first name), in the model's order; ``with_roles``: each with
    the family's role (asked only for an optimizer that uses them: a family may leave some unnamed)."""
    from toolkit.distributed.tensor_parallel import split_parameters

    from toolkit.models.common.moe import GroupedExperts

    split = split_parameters(model)
    experts = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    positions = set(model.position_parameters()) if isinstance(model, PositionTables) else set()
    roles = model.parameter_roles() if with_roles and isinstance(model, ParameterRoles) else {}
    seen, out = set(), []
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        shape = tuple(p.shape)
        expert = id(p) in experts  # [E, out, in]: the grouped GEMM casts it as autocast casts a matmul's weight
        out.append(
            ParamInfo(
                name,
                shape,
                name in split,
                _layer_of(name),
                matmul=(len(shape) == 2 and name not in positions) or expert,
                role=roles.get(name, ""),
                expert=expert,
            )
        )
    return tuple(out)


class _FusedAttentionSaves(torch.autograd.Function):
    """Saves what a fused attention kernel saves: q, k, v, the output and a float32 log-sum-exp per row."""

    @staticmethod
    def forward(ctx, q, k, v):
        B, H, T, _ = q.shape
        Dv = v.size(-1)  # the values' width (latent attention's differs from the queries')
        out = q.new_empty(B, T, H, Dv).transpose(1, 2)  # the kernels' output layout: [B, T, H, Dv] in memory
        lse = q.new_empty(B, H, T, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # never run: the trace stops after forward
        raise NotImplementedError


@contextmanager
def _replaced(owner: Any, name: str, replacement: Any) -> Iterator[None]:
    """``owner.name`` is ``replacement`` inside the ``with`` block (the trace's stand-ins for fused kernels)."""
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _fused_attention() -> Any:
    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return _FusedAttentionSaves.apply(q, k, v)

    return _replaced(F, "scaled_dot_product_attention", sdpa)


class _GroupedGemmSaves(torch.autograd.Function):
    """Saves what the grouped GEMM's autograd saves (the token rows and the expert stack), in their own dtype.

    Why a stand-in: the meta device's grouped-GEMM kernel takes bf16 only, so an fp32 trace through it would
    count bf16 rows and bf16 copies of every expert stack (per sequence) instead of the fp32 rows training saves."""

    @staticmethod
    def forward(ctx, rows, weights):
        ctx.save_for_backward(rows, weights)
        return rows.new_empty(rows.size(0), weights.size(1))

    @staticmethod
    def backward(ctx, grad):  # never run: the trace stops after forward
        raise NotImplementedError


def _grouped_gemm_saves() -> Any:
    from toolkit.models.common import moe

    original = moe._eager_grouped_matmul

    def grouped(rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return _GroupedGemmSaves.apply(rows, weights) if rows.is_meta else original(rows, weights, counts)

    return _replaced(moe, "_eager_grouped_matmul", grouped)


def saved_bytes(model: torch.nn.Module, tokens: int, vocab: int, dtype: torch.dtype) -> int:
    """Bytes autograd saves in one training forward + loss of one sequence (meta device, no memory)."""
    model = model.to(dtype=dtype).train()
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: Dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in params:
            saved.setdefault(key, t)  # kept alive, so that no key is reused
        return t

    x = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _fused_attention(), _grouped_gemm_saves():
        logits = model(x)
        logits = logits[0] if isinstance(logits, (tuple, list)) else logits
        F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), x.reshape(-1), reduction="sum")
    return sum(t.untyped_storage().nbytes() for t in saved.values())


def _first_layers(model_cfg: Any, layers: int) -> Any:
    """``model_cfg`` cut to its first ``layers`` layers, their ``--layer-types`` with them (local and global
    layers: Gemma 3, OLMo 3)."""
    kinds = getattr(model_cfg, "layer_types", None)
    cut = {} if kinds is None else {"layer_types": ",".join(kinds.split(",")[:layers])}
    return dataclasses.replace(model_cfg, decoder_layers=layers, **cut)


def trace_activations(
    model: torch.nn.Module, arch: str, model_cfg: Any, vocab: int, tokens: int, dtype: torch.dtype
) -> Activations:
    """One layer's and the rest's saved bytes per sequence (see the module docstring).

    Parts the meta device cannot run (adaptive input/softmax pick each band's tokens with ``nonzero()``) are
    traced as the stand-in the family gives (``MetaTraceable``: a full embedding and softmax, an upper bound).
    """
    overrides = model.meta_traceable_options() if isinstance(model, MetaTraceable) else {}
    model_cfg = dataclasses.replace(model_cfg, **overrides)
    one = saved_bytes(_build(arch, _first_layers(model_cfg, 1), vocab, tokens), tokens, vocab, dtype)
    two = saved_bytes(_build(arch, _first_layers(model_cfg, 2), vocab, tokens), tokens, vocab, dtype)
    per_layer = two - one
    width = model_cfg.decoder_embed_dim
    return Activations(
        per_layer=per_layer,
        rest=one - per_layer,
        block_input=tokens * width * torch.empty((), dtype=dtype).element_size(),
    )


def check_expert_layout(model: torch.nn.Module, dist: Any) -> None:
    """What toolkit-train refuses for this model's experts, refused before planning: a tensor-parallel plan that
    places experts (``check_plan_kinds``), and ``--expert-parallel-size`` not dividing a layer's experts."""
    from toolkit.core.protocols import TensorParallelizable
    from toolkit.distributed.parallel_dims import check_expert_share
    from toolkit.distributed.tensor_parallel import check_plan_kinds
    from toolkit.models.common.moe import GroupedExperts

    if dist.model_parallel_size > 1 and isinstance(model, TensorParallelizable):
        check_plan_kinds(model.tensor_parallel_plan(), type(model).__name__)
    for experts in (m for m in model.modules() if isinstance(m, GroupedExperts)):
        check_expert_share(dist.expert_parallel_size, experts.num_experts)


def split_limits(model: torch.nn.Module, cfg: Any) -> SplitLimits:
    """The model's :class:`SplitLimits`: what toolkit-train refuses of each split of it (``toolkit/config/
    composition.py``'s MODEL conditions, asked with that split alone on) and the sizes its tensor-parallel plan
    must divide, so that the planner proposes only sizes it trains with."""
    from toolkit.config import composition
    from toolkit.core.protocols import TensorParallelizable
    from toolkit.models.common.moe import GroupedExperts

    M = max(cfg.distributed.model_parallel_size, 2)
    divisible: Tuple[Tuple[str, int], ...] = ()
    refused: Optional[str] = (
        f"--model-parallel-size {M}: {type(model).__name__} gives no tensor_parallel_plan(); use --model-parallel-size 1"
    )
    if isinstance(model, TensorParallelizable):
        plan = model.tensor_parallel_plan()
        refused = composition.model_refusal(_split(cfg, model_parallel_size=M), type(model))
        divisible = tuple(plan.divisible) + (
            (("--tokens-per-sample (max target positions)", plan.positions),)
            if not cfg.distributed.no_sequence_parallel
            else ()
        )
    experts = [m.num_experts for m in model.modules() if isinstance(m, GroupedExperts)]
    return SplitLimits(
        tp_divisible=divisible,
        tp_refused=refused,
        context_parallel=composition.model_refusal(_split(cfg, context_parallel_size=2), type(model)) is None,
        expert_parallel=composition.model_refusal(_split(cfg, expert_parallel_size=2), type(model)) is None,
        pipeline_parallel=composition.model_refusal(_split(cfg, pipeline_parallel_size=2), type(model)) is None
        and getattr(model, "output_projection", None) is not None,  # tied: one weight on the first and last stage
        experts=math.gcd(*experts) if experts else 0,
    )


def _split(cfg: Any, **size: int) -> Any:
    """``cfg`` with one split on and the others off, under FSDP2 (what the layout search tries under TP)."""
    sizes = {
        **dict(model_parallel_size=1, context_parallel_size=1, expert_parallel_size=1, pipeline_parallel_size=1),
        **size,
    }
    return dataclasses.replace(
        cfg, distributed=dataclasses.replace(cfg.distributed, ddp_backend="fully_sharded", **sizes)
    )


def model_stats(cfg: Any, dtype: torch.dtype, vocab: Optional[int] = None) -> ModelStats:
    """The planner's view of ``cfg``'s model (a resolved TrainConfig) computing in ``dtype``."""
    arch, model_cfg = cfg.components.arch, cfg.model
    vocab = vocab or vocab_size_of(cfg)
    tokens = getattr(cfg.task, "tokens_per_sample", None)
    tokens = model_cfg.max_target_positions if tokens is None else tokens
    if tokens is None or tokens < 1:
        raise UserError(
            f"--tokens-per-sample {tokens}: the plan needs the length of a sample; give --tokens-per-sample N (N >= 1)"
        )
    model = _build(arch, model_cfg, vocab, tokens)
    check_expert_layout(model, cfg.distributed)
    infos = param_infos(model, with_roles=bool(getattr(type(cfg.optimizer), "wants_parameter_roles", False)))
    flops = (
        float(model.flops_per_token(tokens)) if isinstance(model, FlopsCounted) else 6.0 * sum(p.numel for p in infos)
    )
    activations = trace_activations(model, arch, model_cfg, vocab, tokens, dtype)
    from toolkit.models.common.moe import MoE
    from toolkit.models.common.attention import AttentionLayer, GatedDeltaNet

    attention = [m for m in model.modules() if isinstance(m, AttentionLayer)]
    recurrent = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    active = model.active_parameters() if hasattr(model, "active_parameters") else None
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    return ModelStats(
        arch=arch,
        params=infos,
        num_layers=model_cfg.decoder_layers,
        embed_dim=model_cfg.decoder_embed_dim,
        vocab_size=vocab,
        tokens_per_sample=tokens,
        flops_per_token=flops,
        activations=activations,
        kv_width=sum(m.kv_width() for m in attention),
        expanded_kv_width=sum(m.expanded_kv_width() for m in attention),
        active_params=active,
        moe_top_k=max((m.gate.top_k for m in moe), default=0),
        moe_layers=len(moe),
        attention_layers=len(attention),
        recurrent_layers=len(recurrent),
        recurrent_state=sum(m.value_heads * m.key_dim * m.value_dim for m in recurrent),
        recurrent_conv=sum((m.conv_kernel - 1) * m.conv_width for m in recurrent),
        splits=split_limits(model, cfg),
    )
