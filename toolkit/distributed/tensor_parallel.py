"""Tensor (model) parallelism of any model family, applied from outside the model by the family's plan.

Megatron's split (fairseq's ``--model-parallel-size``), written with DTensor's
``parallelize_module`` as torchtitan's ``apply_tp`` does. The model names which of its modules
gets which kind of split (``model.tensor_parallel_plan()``, a ``toolkit.core.protocols.
TensorParallelPlan``: ``toolkit/models/transformer_lm/parallel.py``, ``toolkit/models/llama/parallel.py``);
this module holds the DTensor styles of each kind and no parameter name of any family; the meshes come
from the run's layout (``ParallelDims.mesh("tp")``, ``toolkit.distributed.parallel_dims``).
The kinds are an open registry (``register_tp_style(name, sharded=...)``: a function of the run's
layout returning a torch ``ParallelStyle``, and the parameters it divides over the ranks, which
``toolkit-plan`` counts); a new kind registers without editing a list, and a plan naming an unknown
one is refused in one line naming the family and the kind. The built-in kinds, on a mesh of M ranks:

==========================  ===========================  =====================================
kind                        parameter placement          what a rank computes
==========================  ===========================  =====================================
``vocab_embedding``         rows (vocabulary) Shard(0)   lookups of its V/M tokens, all-reduce
``fused_qkv``               Shard(0) of ``[q | k | v]``  q, k and v of its H/M heads
``row``                     Shard(1) (row-parallel)      partial sums, reduce-scatter over T
``column``                  Shard(0) (column-parallel)   its F/M hidden units (or heads)
``norm``                    Replicate                    its T/M positions (sequence parallel)
``positionwise``            Replicate                    as ``norm``: a per-position projection
``gathered_replicated``     Replicate (Partial grads)    every position, input all-gathered
``replicated_partial``      Replicate (Partial grads)    every position, after the one above
``column_on_gathered``      Shard(0)                     its heads, on the gathered positions
``head_norm``               Replicate                    its H/M heads (QK-norm per head)
``attention_sinks``         ``sinks`` [H] Shard(0)       its H/M heads' sink logits
``projection_norm``         Shard(0) (with the heads)    RMSNorm over all heads, its squares
                                                         summed over the ranks (OLMo 2)
``linear_attention_heads``  ``A_log``, ``dt_bias`` [Hv]  its value heads' decays; the
                            Shard(0); conv taps whole    convolution on its own channels
``output``                  Shard(0) (or the tied        its V/M logits; the loss is taken
                            embedding)                   with ``loss_parallel`` (no gather)
==========================  ===========================  =====================================

The residual stream between blocks is split over the sequence (``Shard(1)``, "sequence
parallelism"): LayerNorms and the residual dropouts see T/M positions, so their activations
take 1/M of the memory as well. The embedding output (with positions and its dropout) is
replicated and cut into sequence chunks at the first block, so the model file needs no change
for learned/sinusoidal positions.

Column-parallel layers (``transformer_lm``'s ``qkv_proj``, ``fc1``) gather their sequence-split input inside a
recomputed region (``torch.utils.checkpoint``): a rank keeps T/M positions of it for backward and
gathers again there, as Megatron's sequence parallelism does. The vocabulary-parallel embedding
has its own forward so that its gradient stays Shard(0) (torch's ``RowwiseParallel`` on an
embedding produced a replicated V x C gradient). Every parameter ends up a DTensor on the TP mesh
(LayerNorms, row-parallel biases and learned positions as ``Replicate``): foreach kernels
(optimizer, gradient scaling) refuse lists that mix DTensors and plain tensors. Gradients of
replicated parameters fed by sequence-split activations are ``Partial`` sums until reduced:
FSDP2 reduces them; without it the optimizer's DTensor ops and ``grad_norm.total_norm`` do.

``transformer_lm``'s fused ``qkv_proj`` keeps its parameter as the plain ``Shard(0)`` of the canonical
``[3C, C]`` weight (rows ``[q | k | v]``), so sharded (DCP) checkpoints, FSDP2 on top,
``init_weights`` and the consolidated checkpoint see the same tensor as without tensor
parallelism. Shard(0) of that layout would give rank 0 all of q and part of k, so at forward
the weight is redistributed to ``_StridedShard(0, split_factor=3)``: each rank gets the rows
``[q_r | k_r | v_r]`` of its heads (an all-to-all of 3C^2/M elements per layer on the TP
group, whose backward is the reverse); attention then derives its head count from the local
width. The alternative, a per-head interleaved layout in the model, would change the state
dict.

Dropout (random numbers): DTensor's ``OffsetBasedRNGTracker`` only exists on CUDA-like
devices (on CPU ``is_rng_supported_mesh`` is False and DTensor random ops draw from each
rank's own generator), and our dropouts run on local tensors anyway. So, as Megatron's
``get_cuda_rng_tracker().fork()``: regions whose activations are *replicated* over the TP
ranks (the embedding dropout; the residual dropouts without sequence parallelism) draw from
the default generator, which the trainer seeds identically on every rank with
``seed + num_updates``: same masks. Regions whose activations are *sharded* (attention
dropout on local heads, activation dropout on local hidden units, residual dropouts on local
positions under sequence parallelism) run under a generator forked per TP rank, seeded from
one draw of the default generator and the TP rank: different masks per rank, and the same
masks again for the same (seed, update), so resuming stays exact. Activation checkpointing
(``preserve_rng_state``) restores the default generator before recomputation, so the fork
draws the same seed again and the recomputed masks equal the original ones.

``--compile``: reseeding a generator is not something dynamo can put in a graph, so under tensor
parallelism only each block's ``forward`` is compiled (``toolkit.distributed.compile``): the
block's own hooks, the sequence-parallel fork among them, run eagerly around the compiled code,
which draws from the forked generator. The per-region forks of ``--no-sequence-parallel`` sit
inside the block; compiled, they draw nothing, and ``toolkit.train.resolve`` refuses the
attention/activation dropouts they would serve (``toolkit/config/composition.py``).

LoRA (``--lora-rank``, swapped in before the split): a column-parallel layer's ``lora_B`` is split by its rows
with the layer and ``lora_A`` replicated; a row-parallel layer's ``lora_A`` by its columns and ``lora_B``
replicated, the update's partial sums reduced with the base's (``ADAPTER_SPLIT``). The split keeps the
frozen parameters frozen (torch's styles make trainable Parameters of what they distribute).

``--fp8``: the float8 swap comes first (``toolkit.distributed.float8``); the row-parallel layers
keep torchao's ``Float8Linear`` on DTensors, and the column-parallel classes mix in
``_Float8Local``, which computes this rank's matmul in float8 with the module's own config.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.core.protocols import TensorParallelizable, TensorParallelPlan
from toolkit.core.errors import UserError


# --- custom styles: the fused q/k/v projection and the vocabulary-parallel embedding -------------


class _ColumnParallelLinear(nn.Linear):
    """Column-parallel ``fc1``: weight and bias Shard(0); this rank computes its output features.

    The input arrives split over the sequence (``input_layout`` Shard(1), sequence parallel) or
    replicated. The all-gathered input is not kept for backward: the gather and the matmul are
    recomputed there (Megatron's sequence parallelism re-gathers the same way), so a rank keeps
    T/M positions of it, not T.
    """

    input_layout = None  # set by the style: the placement of a plain-tensor input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self._project(x)
        return torch.utils.checkpoint.checkpoint(self._project, x, use_reentrant=False, preserve_rng_state=False)

    def _local_weights(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        return self._rows(self.weight), self._rows(self.bias) if self.bias is not None else None

    def _rows(self, tensor) -> torch.Tensor:
        """This rank's output rows of a Shard(0) parameter, as it computes them."""
        return tensor.to_local()

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.weight.device_mesh, [self.input_layout], run_check=False)
        # Every rank uses all of x for its own features: x's gradient is a sum over the ranks.
        x = x.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
        weight, bias = self._local_weights()
        return self._local_linear(x, weight, bias)

    def _local_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return F.linear(x, weight, bias)


class _AdaptedLocal:
    """Mixed into a column-parallel class when the module is a LoRA-adapted Linear (``toolkit.models.lora``):
    this rank's output features get their low-rank update from the whole ``lora_A`` (replicated; each rank's
    gradient of it, through its rows of ``lora_B``, is a ``Partial`` sum, reduced as the norms' are) and this
    rank's rows of ``lora_B`` (Shard(0), the base weight's split)."""

    def _local_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        from torch.distributed.tensor import Partial

        out = super()._local_linear(x, weight, bias)
        down = self.lora_A.weight.to_local(grad_placements=[Partial()])
        update = F.linear(F.linear(self.lora_dropout(x), down), self._rows(self.lora_B.weight))
        return out + update.to(out.dtype) * self.scaling


#: each adapter's placement under a split of the layer it adapts: column-parallel (the output rows split), lora_B
#: by its rows and lora_A whole; row-parallel (the input columns split), lora_A by its columns and lora_B whole,
#: so the update's partial products are reduced with the base's
ADAPTER_SPLIT = {"column": {"lora_A": None, "lora_B": 0}, "row": {"lora_A": 1, "lora_B": None}}


def _is_adapted(module: nn.Module) -> bool:
    from toolkit.models.lora import LoRALinear

    return isinstance(module, LoRALinear)


def _distribute_adapters(module: nn.Module, device_mesh, kind: str) -> None:
    """A LoRA-adapted layer's ``lora_A``/``lora_B`` weights as DTensors placed by ``ADAPTER_SPLIT[kind]``."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if not _is_adapted(module):
        return
    for part, dim in ADAPTER_SPLIT[kind].items():
        adapter = module.get_submodule(part)
        placement = Replicate() if dim is None else Shard(dim)
        dist = distribute_tensor(adapter.weight, device_mesh, [placement], src_data_rank=None)
        adapter.register_parameter("weight", nn.Parameter(dist, requires_grad=adapter.weight.requires_grad))


class _ColumnParallelOnWhole(_ColumnParallelLinear):
    """Column-parallel on an input every rank already holds whole and whose gradient here is this rank's part
    (the output of a ``gathered_replicated`` module): no gather, and the input's gradient left partial, summed
    where that region began."""

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self._local_weights()
        return self._local_linear(x, weight, bias)


class _Float8Local:
    """Mixed into a column-parallel class when the module was a float8 ``Float8Linear`` (``--fp8``, swapped
    in before the split): this rank's matmul runs in float8 with the module's own torchao config."""

    def _local_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        from toolkit.distributed.float8 import float8_matmul

        return float8_matmul(self, x, weight, bias)


class _HeadParallelQKV(_ColumnParallelLinear):
    """``qkv_proj``: stored Shard(0) of ``[q | k | v]``, computed on this rank's heads ``[q_r | k_r | v_r]``."""

    def _rows(self, tensor) -> torch.Tensor:
        from torch.distributed.tensor.placement_types import _StridedShard

        return tensor.redistribute(placements=[_StridedShard(0, split_factor=3)]).to_local()  # its q, k and v rows


class _VocabParallelEmbedding(nn.Embedding):
    """``embed_tokens`` with rows Shard(0): each rank looks up its own tokens (zeros elsewhere), summed over TP.

    torch's ``RowwiseParallel`` does the same forward, but its backward produced a
    replicated V x C gradient on every rank; this one keeps the gradient Shard(0).
    """

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        weight = self.weight
        (rows, _), (start, _) = compute_local_shape_and_global_offset(
            weight.shape, weight.device_mesh, weight.placements
        )
        ids = tokens - start
        outside = (ids < 0) | (ids >= rows)
        pad = (
            self.padding_idx - start if self.padding_idx is not None and 0 <= self.padding_idx - start < rows else None
        )
        out = F.embedding(ids.masked_fill(outside, 0), weight.to_local(), padding_idx=pad)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        partial = DTensor.from_local(out, weight.device_mesh, [Partial()], run_check=False)
        return partial.redistribute(placements=[Replicate()]).to_local()


def _is_float8(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"


@functools.cache
def _with_float8(cls: type) -> type:
    """``cls`` computing its local matmul in float8 (one class per column-parallel kind)."""
    return type(f"{cls.__name__.lstrip('_')}Float8", (_Float8Local, cls), {})


@functools.cache
def _with_adapters(cls: type, adapted: type) -> type:
    """``cls`` adding a LoRA update to its local matmul, still an ``adapted`` (the LoRA class: its initial values,
    what finds the adapters); one class per column-parallel kind."""
    return type(f"{cls.__name__.lstrip('_')}LoRA", (_AdaptedLocal, cls, adapted), {})


def float8_layers(model: nn.Module) -> str:
    """How many float8 Linear layers the split kept (a check that no style dropped one), for the log."""
    float8 = [m for m in model.modules() if "Float8" in type(m).__name__]
    column = sum(isinstance(m, _Float8Local) for m in float8)
    return f"float8 Linear layers after the split: {len(float8)} ({column} column-parallel)"


def _swap_class_style(cls: type, shard_dim: int, input_layout=None):
    """A ParallelStyle: parameters Shard(shard_dim) on the TP mesh, and the module computes with ``cls.forward``."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    class _Style(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            for name, param in list(module.named_parameters(recurse=False)):
                dist = distribute_tensor(param, device_mesh, [Shard(shard_dim)], src_data_rank=None)
                module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))
            # Same parameters and state-dict keys, another forward (FSDP2 swaps classes the same way).
            if _is_adapted(module):
                _distribute_adapters(module, device_mesh, "column")
                module.__class__ = _with_adapters(cls, type(module))
            else:
                module.__class__ = _with_float8(cls) if _is_float8(module) else cls
            if input_layout is not None:
                module.input_layout = input_layout
            return module

    return _Style()


def _replicate_parameters(_name: str, module: nn.Module, mesh) -> None:
    """``distribute_module``'s partition function: the module's own parameters as ``Replicate`` DTensors."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, mesh, [Replicate()], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class _ReplicatedParallel:
    """Parameters replicated over the TP ranks (DTensor ``Replicate``), computed on plain tensors.

    For the modules outside the split (learned positions; LayerNorms without sequence
    parallelism): every parameter of the model is then a DTensor on the TP mesh, which
    foreach kernels (optimizer, gradient scaling) need, as they refuse mixed lists.
    """

    @staticmethod
    def style():
        from torch.distributed.tensor import DTensor, Replicate, distribute_module
        from torch.distributed.tensor.parallel import ParallelStyle

        def inputs(_module, args, mesh):
            return tuple(
                DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
                else a
                for a in args
            )

        def outputs(_module, output, _mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        class _Style(ParallelStyle):
            def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
                return distribute_module(module, device_mesh, _replicate_parameters, inputs, outputs)

        return _Style()


# --- random numbers: one generator per TP rank in sharded regions --------------------------------


def _derived_seed(draw: int, tp_rank: int) -> int:
    digest = hashlib.sha256(f"tp/{draw}/{tp_rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def fork_rng_per_tp_rank(start: nn.Module, tp_rank: int, device: torch.device, end: Optional[nn.Module] = None) -> None:
    """From ``start``'s forward to the end of ``end``'s (default: ``start``), draw from a generator
    seeded from (one draw of the default generator, TP rank); the default generator is restored after."""
    stacks = []

    def enter(_module, _inputs):
        if torch.compiler.is_compiling():  # inside a compiled block (--no-sequence-parallel, module docstring)
            return
        draw = int(torch.randint(0, 2**62, (1,)).item())  # advances the default stream alike on every rank
        stack = contextlib.ExitStack()
        devices = [device.index or 0] if device.type != "cpu" else []
        stack.enter_context(torch.random.fork_rng(devices=devices, device_type=device.type))
        torch.manual_seed(_derived_seed(draw, tp_rank))
        stacks.append(stack)

    def leave(_module, _inputs, _output):
        if stacks:
            stacks.pop().close()

    start.register_forward_pre_hook(enter)
    (end or start).register_forward_hook(leave, always_call=True)


def _replicate_hidden_hook(tp_mesh, sequence_parallel: bool):
    """Forward hook on the module before the output projection: its output as a replicated DTensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def hook(_module, _inputs, output):
        if not isinstance(output, DTensor):
            layout = [Shard(1)] if sequence_parallel else [Replicate()]
            output = DTensor.from_local(output, tp_mesh, layout, run_check=False)
        return output.redistribute(placements=[Replicate()])

    return hook


def _pad_sequence_hooks(model: nn.Module, M: int, padding_idx: int) -> None:
    """Sequence parallelism cuts T into M equal parts: a batch of T % M != 0 positions (an epoch's
    short last block) is right-padded to a multiple of M and its logits cut back to T. Padding on
    the right changes no earlier position (causal attention)."""
    lengths = []

    def pad(_module, args):
        tokens = args[0]
        T = tokens.size(1)
        lengths.append(T)
        if T % M == 0:
            return None
        return (F.pad(tokens, (0, M - T % M), value=padding_idx), *args[1:])

    def cut(_module, _inputs, output):
        T = lengths.pop()
        logits = output[0] if isinstance(output, tuple) else output  # a training MoE's (logits, extras)
        if logits.size(1) == T:
            return output
        return (logits[:, :T], *output[1:]) if isinstance(output, tuple) else logits[:, :T]

    model.register_forward_pre_hook(pad)
    model.register_forward_hook(cut, always_call=True)


def _gather_logits_hook(_module, _inputs, logits):
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(logits, DTensor):
        return logits.redistribute(placements=[Replicate()]).to_local()
    return logits


def _check_every_parameter_split(model: nn.Module, M: int, whole: Tuple[str, ...] = ()) -> None:
    """Every parameter is a DTensor on the TP mesh, but those of the block paths in ``whole`` (the plan's
    experts: whole on every tp rank, plain tensors FSDP2 shards on a mesh of their own): a layer the plan missed
    fails here, in one line, instead of at its first forward (``aten.mm.default got mixed torch.Tensor and
    DTensor``)."""
    from torch.distributed.tensor import DTensor

    inside = tuple(f".{path}." for path in whole)  # in any block: the decoder's, a prediction depth's
    missed = [
        name
        for name, p in model.named_parameters()
        if not isinstance(p, DTensor) and not any(part in f".{name}" for part in inside)
    ]
    if missed:
        raise UserError(
            f"--model-parallel-size {M}: {missed[0]} is not in the tensor-parallel plan "
            f"({type(model).__name__}.tensor_parallel_plan()); use --model-parallel-size 1 with this model"
        )


def _replicated_weights_style():
    """Parameters replicated over the TP ranks; the module computes on DTensors as they come (no hooks)."""
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class _Style(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            return distribute_module(module, device_mesh, _replicate_parameters)

    return _Style()


def _compute_on_local_values(module: nn.Module, grad_placements) -> None:
    """Around each forward, the module's own DTensor parameters read as their local values (``grad_placements``:
    the placement their gradient takes, None: the parameter's own), the Parameters put back after; the module's
    code then computes on plain tensors and needs no change."""

    def local(module, _args):
        module._tp_parameters = {}
        for name in [n for n, p in module._parameters.items() if p is not None]:
            param = module._tp_parameters[name] = module._parameters.pop(name)
            module.__dict__[name] = param.to_local(grad_placements=grad_placements)

    def restore(module, _args, _output):
        for name, param in module.__dict__.pop("_tp_parameters", {}).items():
            module.__dict__.pop(name, None)
            module._parameters[name] = param

    module.register_forward_pre_hook(local)
    module.register_forward_hook(restore, always_call=True)


def _local_parameters_style(gather_input: Optional[object]):
    """Parameters replicated over the TP ranks, computed on their local values whose gradient is a ``Partial`` sum
    (the module's output feeds this rank's heads only, so its gradient here is this rank's part); with
    ``gather_input`` (the input's placement), the input all-gathered over the sequence first, its gradient
    reduce-scattered back (summed over the ranks' parts). For the modules latent attention runs on every position
    before its head-parallel up-projections: the key/value compression, whose rotary key part no column-parallel
    layer gathers (``toolkit.models.deepseek_v3.parallel``)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    def gathered(_module, args, mesh):
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [gather_input], run_check=False)
        return (x.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()]), *args[1:])

    class _Style(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            distribute_module(module, device_mesh, _replicate_parameters, gathered if gather_input else None)
            _compute_on_local_values(module, [Partial()])
            return module

    return _Style()


def _head_vectors_style(names: Tuple[str, ...]):
    """The module's own parameters ``names``, one value per query head ([H], such as attention sinks), Shard(0)
    on the TP mesh: rank r holds the values of its heads, the contiguous block of H/M that the column-parallel
    ``q_proj`` gives it, and the module computes on them as plain tensors (its submodules keep their own kinds);
    each rank's gradient is its heads' part, Shard(0) as the parameter."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    class _Style(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            for name in names:
                param = module._parameters.get(name)
                if param is not None:
                    dist = distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=None)
                    module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))
            _compute_on_local_values(module, None)
            return module

    return _Style()


def _all_reduced_sum(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``x`` over ``group``: the functional collective, which a compiled block traces, and whose
    registered backward sums the gradients over the group."""
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))


@functools.cache
def _width_sharded(norm_class: type) -> type:
    """``norm_class`` (an RMSNorm: ``mean_square`` over the last dim) on this rank's part of that dim."""

    class _WidthSharded(norm_class):
        def mean_square(self, x32: torch.Tensor) -> torch.Tensor:
            return _all_reduced_sum(x32.pow(2).sum(-1, keepdim=True), self.tp_group) / self.full_width

    _WidthSharded.__name__ = f"WidthSharded{norm_class.__name__}"
    return _WidthSharded


def _width_sharded_norm_style():
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    class _Style(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            module.full_width = module.weight.shape[0]
            dist = distribute_tensor(module.weight, device_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter("weight", nn.Parameter(dist, requires_grad=module.weight.requires_grad))
            module.tp_group = device_mesh.get_group()
            module.__class__ = _width_sharded(type(module))
            _compute_on_local_values(module, None)
            return module

    return _Style()


def _linear_attention_style():
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    def local_taps(module, _args):
        conv = module.conv1d
        taps = conv._parameters.pop("weight")
        conv.__dict__["_tp_weight"] = taps  # beside the module's parameters, not one of them
        channels = module.tensor_parallel_channels(taps.device_mesh.get_local_rank(), taps.device_mesh.size())
        conv.__dict__["weight"] = taps.to_local(grad_placements=[Partial()])[channels.to(taps.device)]

    def restore(module, _args, _output):
        conv = module.conv1d
        conv.__dict__.pop("weight", None)
        conv._parameters["weight"] = conv.__dict__.pop("_tp_weight")

    class _Style(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            if not hasattr(module, "tensor_parallel_channels"):
                return module
            for name in ("A_log", "dt_bias"):
                param = module._parameters[name]
                dist = distribute_tensor(param, device_mesh, [Shard(0)], src_data_rank=None)
                module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))
            taps = module.conv1d.weight
            dist = distribute_tensor(taps, device_mesh, [Replicate()], src_data_rank=None)
            module.conv1d.register_parameter("weight", nn.Parameter(dist, requires_grad=taps.requires_grad))
            module.register_forward_pre_hook(local_taps)
            module.register_forward_hook(restore, always_call=True)
            _compute_on_local_values(module, None)
            return module

    return _Style()


def loss_context(enabled: bool):
    """Around forward *and* backward of the loss when the logits are vocabulary-sharded (torch's ``loss_parallel``)."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


# --- the plan: the model names a kind per module (toolkit.core.protocols), the styles come from here ---------


def model_plan(model: nn.Module, M: int) -> TensorParallelPlan:
    """The model's own plan; a model without one is refused in one line (it cannot be split)."""
    if not isinstance(model, TensorParallelizable):
        raise UserError(
            f"--model-parallel-size {M}: {type(model).__name__} gives no tensor_parallel_plan() "
            f"(toolkit.core.protocols.TensorParallelizable); use --model-parallel-size 1"
        )
    return model.tensor_parallel_plan()


def _check_divisible(model: nn.Module, M: int, sequence_parallel: bool = True) -> None:
    """One line naming the size that M does not divide (the vocabulary may split unevenly; positions may not)."""
    plan = model_plan(model, M)
    sizes = list(plan.divisible)
    if sequence_parallel:
        sizes.append(("--tokens-per-sample (max target positions)", plan.positions))
    for flag, value in sizes:
        if value % M:
            raise UserError(
                f"{flag} {value}: must be divisible by --model-parallel-size {M} (each rank holds "
                f"whole heads and an equal share); choose a model parallel size that divides it"
            )


# --- the kinds: an open registry of names -> DTensor styles (a new kind registers here, no list to edit) ----


@dataclass(frozen=True)
class StyleContext:
    """What a style may depend on: the layout of the run, not the module it is given."""

    sequence_parallel: bool
    block_inputs: int = 1  # positional inputs of a block (the stream first)

    @property
    def stream_layout(self):
        """The residual stream's placement between blocks: Shard(1) under sequence parallelism, else Replicate."""
        from torch.distributed.tensor import Replicate, Shard

        return Shard(1) if self.sequence_parallel else Replicate()


@dataclass(frozen=True)
class TPStyle:
    """One registered kind: ``build(StyleContext)`` gives its ``ParallelStyle`` (None: nothing to do in this
    layout); ``sharded`` names the module's own parameters it divides over the TP ranks (``toolkit-plan``
    counts 1/M of those, whole copies of the others)."""

    name: str
    build: Callable[[StyleContext], Optional[object]]
    sharded: Tuple[str, ...] = ()


TP_STYLES: Dict[str, TPStyle] = {}


def register_tp_style(name: str, sharded: Tuple[str, ...] = ()):
    """Decorator: ``build(ctx) -> ParallelStyle | None`` is the style of kind ``name`` in a family's plan."""

    def register(build: Callable[[StyleContext], Optional[object]]):
        if name in TP_STYLES and TP_STYLES[name].build is not build:
            raise ValueError(f"tensor-parallel kind {name!r} is registered twice")
        TP_STYLES[name] = TPStyle(name, build, tuple(sharded))
        return build

    return register


def tp_style(kind: str, owner: str, path: str) -> TPStyle:
    """The registered kind, or one line naming the family (``owner``), the module and the kind."""
    if kind not in TP_STYLES:
        raise UserError(
            f"{owner}.tensor_parallel_plan(): {path!r} has kind {kind!r}, which no "
            f"register_tp_style registered (known: {', '.join(sorted(TP_STYLES))}); register it "
            f"(toolkit.distributed.tensor_parallel.register_tp_style) or name a known kind"
        )
    return TP_STYLES[kind]


EXPERT_PLACEMENTS = ("ep_shard",)  # toolkit.distributed.expert_parallel


def check_plan_kinds(plan: TensorParallelPlan, owner: str) -> None:
    """Every kind of ``plan`` registered, and every expert placement one the toolkit places (``ep_shard``: the
    experts' leading dimension over the ep ranks, each expert whole and replicated over the tp ranks):
    refused before anything is sharded."""
    for path, kind in {**plan.top, **plan.block}.items():
        tp_style(kind, owner, path)
    for path, placement in plan.experts.items():
        if placement not in EXPERT_PLACEMENTS:
            raise UserError(
                f"{owner}.tensor_parallel_plan(): {path!r} asks for expert-parallel placement {placement!r}, "
                f"which the toolkit does not place (known: {', '.join(EXPERT_PLACEMENTS)}); name a known "
                f"one or leave the experts out of the plan"
            )


@register_tp_style("vocab_embedding", sharded=("weight",))
def _vocab_embedding(_ctx: StyleContext):
    return _swap_class_style(_VocabParallelEmbedding, 0)


@register_tp_style("output", sharded=("weight", "bias"))
def _output(_ctx: StyleContext):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)


@register_tp_style("column", sharded=("weight", "bias"))
def _column(ctx: StyleContext):
    return _swap_class_style(_ColumnParallelLinear, 0, input_layout=ctx.stream_layout)


@register_tp_style("fused_qkv", sharded=("weight", "bias"))
def _fused_qkv(ctx: StyleContext):
    return _swap_class_style(_HeadParallelQKV, 0, input_layout=ctx.stream_layout)


@register_tp_style("row", sharded=("weight",))
def _row(ctx: StyleContext):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    class _Rowwise(RowwiseParallel):
        """torch's row-parallel split of the layer's own weight and bias; a LoRA-adapted layer's adapters by
        ``ADAPTER_SPLIT`` (its forward then computes on DTensors: the update a ``Partial`` sum like the base's)."""

        def _partition_linear_fn(self, name, module, device_mesh):
            if name == "":
                super()._partition_linear_fn(name, module, device_mesh)
                _distribute_adapters(module, device_mesh, "row")

    return _Rowwise(output_layouts=Shard(1)) if ctx.sequence_parallel else _Rowwise()


@register_tp_style("norm")
def _norm(ctx: StyleContext):
    from torch.distributed.tensor.parallel import SequenceParallel

    return SequenceParallel(use_local_output=True) if ctx.sequence_parallel else _ReplicatedParallel.style()


@register_tp_style("head_norm")
def _head_norm(_ctx: StyleContext):
    """A norm over each head's features (QK-norm per head) on this rank's heads, [B, T, H/M, D]: the input is a
    ``Shard(2)`` of all the heads, the weight (one vector of D) replicated, its gradient the sum over every rank's
    heads (a ``Partial``, reduced as the sequence-parallel norms' are)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    return SequenceParallel(sequence_dim=2, use_local_output=True)


@register_tp_style("attention_sinks", sharded=("sinks",))
def _attention_sinks(_ctx: StyleContext):
    """The attention module's own ``sinks`` (gpt-oss: one logit per query head in each softmax) split as its query
    heads; its projections are planned apart (``q_proj`` column, ``o_proj`` row)."""
    return _head_vectors_style(("sinks",))


@register_tp_style("projection_norm", sharded=("weight",))
def _projection_norm(_ctx: StyleContext):
    """An RMSNorm over a whole column-parallel projection's output (OLMo 2's QK-norm over all heads of q or k) on this
    rank's heads, [B, T, H/M * D]: the weight Shard(0) as the projection's rows, the mean of the squares the sum of
    every rank's part (one all-reduce of [B, T, 1] per norm, its backward another) over the full width."""
    return _width_sharded_norm_style()


@register_tp_style("linear_attention_heads", sharded=("A_log", "dt_bias"))
def _linear_attention_heads(_ctx: StyleContext):
    """A gated DeltaNet layer's own per-value-head vectors (``A_log``, ``dt_bias`` [Hv]) Shard(0) as its
    column-parallel projections' heads, and its depthwise convolution's taps (a few per channel) whole on every rank,
    each rank reading the rows of its own channels (the module's ``tensor_parallel_channels``), their gradient a
    ``Partial`` sum; a module without them (a full-attention layer of the same block plan) is left as it is."""
    return _linear_attention_style()


@register_tp_style("replicated")
def _replicated(_ctx: StyleContext):
    return _ReplicatedParallel.style()


@register_tp_style("gathered_replicated")
def _gathered_replicated(ctx: StyleContext):
    """A module on every position of the sequence (its input gathered under sequence parallelism), whole on every
    rank, whose output feeds this rank's heads (``_local_parameters_style``)."""
    return _local_parameters_style(ctx.stream_layout)


@register_tp_style("replicated_partial")
def _replicated_partial(_ctx: StyleContext):
    """A module after a ``gathered_replicated`` one on the same positions (its norm), whole on every rank."""
    return _local_parameters_style(None)


@register_tp_style("column_on_gathered", sharded=("weight", "bias"))
def _column_on_gathered(_ctx: StyleContext):
    """Column-parallel after a ``gathered_replicated`` module (latent attention's ``kv_b_proj``)."""
    return _swap_class_style(_ColumnParallelOnWhole, 0)


@register_tp_style("positionwise")
def _positionwise(ctx: StyleContext):
    """A module acting on each position alone (a projection before a column-parallel one, its norm): whole on
    every rank, on this rank's positions under sequence parallelism, as a norm."""
    return _norm(ctx)


@register_tp_style("gathered_norm")
def _gathered_norm(ctx: StyleContext):
    """A norm whose output the output layer reads besides the final one (a multi-token prediction depth's,
    ``common/mtp.py``): as ``norm``, its output then replicated as ``plan.hidden``'s is."""
    from torch.distributed.tensor.parallel import ParallelStyle

    norm, sequence_parallel = _norm(ctx), ctx.sequence_parallel

    class _Gathered(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            module = norm._apply(module, device_mesh)
            module.register_forward_hook(_replicate_hidden_hook(device_mesh, sequence_parallel))
            return module

    return _Gathered()


@register_tp_style("replicated_weights")
def _replicated_weights(_ctx: StyleContext):
    return _replicated_weights_style()


@register_tp_style("sequence_split")
def _sequence_split(ctx: StyleContext):
    """The replicated embedding output cut into sequence chunks at the first block (a local slice; all-gather
    in backward); a block's other inputs (rotary tables) stay whole. Sequence parallelism only."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    if not ctx.sequence_parallel:
        return None
    rest = (None,) * (ctx.block_inputs - 1)
    return PrepareModuleInput(
        input_layouts=(Replicate(),) + rest, desired_input_layouts=(Shard(1),) + rest, use_local_output=True
    )


@register_tp_style("sequence_input")
def _sequence_input(ctx: StyleContext):
    """A module that sees [B, T/M, C] as a DTensor of [B, T, C] (its shape gives T). Sequence parallelism only."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput

    if not ctx.sequence_parallel:
        return None
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),))


def _styles(entries: Dict[str, str], ctx: StyleContext, owner: str = "the model") -> Dict[str, object]:
    styles = {path: tp_style(kind, owner, path).build(ctx) for path, kind in entries.items()}
    return {path: style for path, style in styles.items() if style is not None}


def block_plan(plan: TensorParallelPlan, sequence_parallel: bool) -> Dict[str, object]:
    """The styles of one block of ``plan`` (the same for every block)."""
    return _styles(plan.block, StyleContext(sequence_parallel, plan.block_inputs))


def fsdp_units(model: nn.Module) -> list:
    """The modules FSDP2 shards as units before the root, as the model's plan lists them (``fsdp_units``; a
    ``ModuleList`` path: each entry); a model without a plan: the blocks of ``model.layers``."""
    paths = model.tensor_parallel_plan().fsdp_units if isinstance(model, TensorParallelizable) else ("layers",)
    units = []
    for path in paths:
        module = model.get_submodule(path)
        units.extend([m for m in module if m is not None] if isinstance(module, nn.ModuleList) else [module])
    return units


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def split_parameters(model: nn.Module) -> set:
    """Names of the parameters the model's plan divides over the TP ranks (what ``toolkit-plan`` counts 1/M of):
    each planned module's own parameters its kind's style shards; empty for a model without a plan."""
    if not isinstance(model, TensorParallelizable):
        return set()
    plan, owner = model.tensor_parallel_plan(), type(model).__name__
    entries = {path: tp_style(kind, owner, path) for path, kind in plan.top.items()}
    for i, block in enumerate(model.layers):  # a path a block lacks is skipped, as parallelize_module skips it
        present = {path: kind for path, kind in plan.block.items() if _has_submodule(block, path)}
        entries.update({f"layers.{i}.{path}": tp_style(kind, owner, path) for path, kind in present.items()})
    split = set()
    for path, style in entries.items():
        module = model.get_submodule(path)
        split.update(f"{path}.{name}" for name, _ in module.named_parameters(recurse=False) if name in style.sharded)
    return split


def _fork_dropout_streams(
    plan: TensorParallelPlan, block: nn.Module, tp_rank: int, device: torch.device, sequence_parallel: bool
) -> None:
    """Per-rank random streams where the block's dropouts act on this rank's share (module docstring)."""
    if not plan.sharded_dropout:
        return
    if sequence_parallel:  # every dropout of the block acts on local positions, heads or units
        fork_rng_per_tp_rank(block, tp_rank, device)
        return
    for start, end in plan.sharded_dropout:  # e.g. attention on local heads; fc1 -> fc2 on local units
        fork_rng_per_tp_rank(block.get_submodule(start), tp_rank, device, end=block.get_submodule(end))


def _present(model: nn.Module, path: str) -> bool:
    """``path`` names a module ``model`` holds: a pipeline stage keeps only its own (another stage's embeddings,
    final norm, head and blocks are None)."""
    try:
        return model.get_submodule(path) is not None
    except AttributeError:
        return False


def apply_tensor_parallel(
    model: nn.Module, tp_mesh, sequence_parallel: bool = True, loss_parallel: bool = True, pad_sequence: bool = True
) -> nn.Module:
    """Shard ``model`` (on the meta device or materialized) over ``tp_mesh`` by its ``tensor_parallel_plan()``.

    Call before activation checkpointing and FSDP2 (torchtitan's order). With
    ``loss_parallel`` the model returns vocabulary-sharded logits (a DTensor, ``Shard(2)``)
    and forward/backward of the loss must run under :func:`loss_context`; otherwise
    the logits are gathered into a plain [B, T, V] tensor.

    A pipeline stage (``toolkit.distributed.pipeline``) is split the same way, module by module, over the modules
    it holds; its tokens are padded to a multiple of the tp size before the schedule cuts them into micro-batches
    (``pad_sequence=False``: its later stages take hidden states, not tokens).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    M = tp_mesh.size()
    plan = model_plan(model, M)
    owner = type(model).__name__
    check_plan_kinds(plan, owner)
    _check_divisible(model, M, sequence_parallel)
    tp_rank = tp_mesh.get_local_rank()
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]  # LoRA's base
    device = (
        torch.device(tp_mesh.device_type, torch.cuda.current_device())
        if tp_mesh.device_type == "cuda"
        else torch.device(tp_mesh.device_type)
    )
    top = {path: kind for path, kind in plan.top.items() if _present(model, path)}
    parallelize_module(
        model, tp_mesh, _styles(top, StyleContext(sequence_parallel, plan.block_inputs), owner), src_data_rank=None
    )
    if sequence_parallel and pad_sequence:
        _pad_sequence_hooks(model, M, plan.padding_idx)
    for block in [block for block in model.layers if block is not None]:
        parallelize_module(block, tp_mesh, block_plan(plan, sequence_parallel), src_data_rank=None)
        _fork_dropout_streams(plan, block, tp_rank, device, sequence_parallel)
    if _present(model, plan.hidden):
        model.get_submodule(plan.hidden).register_forward_hook(_replicate_hidden_hook(tp_mesh, sequence_parallel))
    if not loss_parallel:
        model.register_forward_hook(_gather_logits_hook)
    _check_every_parameter_split(model, M, tuple(plan.experts))
    for name in frozen:  # torch's styles make new Parameters (trainable) of the ones they split
        model.get_parameter(name).requires_grad_(False)
    return model
