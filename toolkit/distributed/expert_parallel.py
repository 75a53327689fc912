"""``--expert-parallel-size P``: each MoE layer's stacked experts spread over P data-parallel ranks.

:func:`apply_expert_parallel` keeps E/P consecutive experts of each layer on each rank of the ``ep`` group
(``GroupedExperts.place``; the tokens travel by all-to-all, ``toolkit.models.common.moe``), on the meta device,
after tensor parallelism and before FSDP2 (torchtitan's order); ``init_weights`` then draws each whole stack and
keeps this rank's part (``GroupedExperts.initial_parts``), so the values are one process's. Those shards
differ between the ranks of one ep group. Under DDP and ``no_c10d`` they are left out of the all-reduce of the
rest; instead :class:`ExpertGradients` sums them over the ranks that hold the same experts (``EXPERT_PEERS``,
world / P ranks) and divides by the world size, as DDP averages the rest: each shard's gradient already holds
the contributions of the tokens of all P ranks, brought back by the exchange's backward.

Under FSDP2 (torchtitan's layout) :func:`shard_experts` ``fully_shard``-s each layer's E/P experts over the ranks
holding the same ones (``dims.mesh(*EXPERT_PEERS)``, (dp_shard x cp) / P ranks), while the rest of the block is
sharded over all dp_shard x cp ranks as without experts (under HSDP that mesh is (replicate, shard), as the dense
layers': the peers span the replica groups). FSDP2 then reduces the expert gradients among those peers only,
divided by the same data-parallel size as the dense ones (``set_gradient_divide_factor``).

Checkpoints hold the whole stacks, consolidated and sharded (``--use-sharded-state``: each rank of an ep group
holds other experts under the same name, so DCP is given the one [E, ...] stack every rank agrees on): the experts'
state_dict hooks gather the weights, and :func:`gather_optimizer_state` / :func:`own_optimizer_state` do the same
for their optimizer moments (cpu_adam's fp16 moments put on one scale first), so a checkpoint saved at one P
resumes at any other (1 included; tests/integration/test_expert_parallel_resume.py,
test_expert_parallel_sharded_resume.py). The cost: each rank holds a layer's whole stacks while it saves or loads.
"""

from __future__ import annotations

from typing import Any, Dict, List, Set

import torch

from toolkit.distributed.parallel_dims import CONTEXT_AXES, EXPERT_PEERS, ParallelDims
from toolkit.models.common.moe import MoE, GroupedExperts
from toolkit.models.init import canonical_name


def apply_expert_parallel(model: torch.nn.Module, dims: ParallelDims) -> int:
    """Place every MoE layer's experts on this rank's share (on the meta device: ``init_weights`` then draws each
    whole stack and keeps this rank's part); the number of layers placed."""
    ep = dims.mesh("ep")
    layers = [module for module in model.modules() if isinstance(module, GroupedExperts)]
    for module in layers:
        module.place(ep.get_group(), ep.get_local_rank(), dims.shape.ep)
    return len(layers)


def shard_experts(unit: torch.nn.Module, dims: ParallelDims, **fsdp_options: Any) -> None:
    """``fully_shard`` each placed expert stack of ``unit`` (a block, before the block itself) over the ranks that
    hold the same experts; their summed gradient is divided by the dense layers' data-parallel size, so both
    are the average over every rank's tokens."""
    from torch.distributed.fsdp import fully_shard

    for module in unit.modules():
        if isinstance(module, GroupedExperts) and module.ep_group is not None:
            # the dense layers' FSDP2 divides by its whole mesh, replicas x shards (dims.loss_world under FSDP2)
            mesh = dims.mesh(*EXPERT_PEERS)
            _fully_shard_summed(module, mesh, float(dims.shape.loss_world), fully_shard, fsdp_options)


def shard_moe_replicated_over_tp(
    unit: torch.nn.Module, dims: ParallelDims, sequence_parallel: bool, **fsdp_options: Any
) -> None:
    """Under tensor parallelism (torchtitan's layout when experts are not split over tp): each MoE layer of ``unit``
    (a block, before the block itself) is whole on every tp rank, replicated over tp like the residual stream it
    reads, and ``fully_shard``-ed by FSDP2 on its own 1-D mesh: its placed experts over the ranks holding the same
    ones (their ep peers x the tp ranks), the router and shared experts over
    every rank. The gradient summed over that mesh is divided so that it is the average over the data-parallel
    ranks: under sequence parallelism each tp rank routed its own positions, so the tp ranks' gradients are parts to
    add (divide by the data-parallel size); without it they are copies (divide by the whole mesh's, tp included).
    Under a pipeline those are the ranks of this rank's stage (``CONTEXT_AXES``), which alone hold the layer: a
    mesh spanning another stage's ranks would gather with ranks that are running other layers, or waiting for this
    stage's activations."""
    from torch.distributed.fsdp import fully_shard

    stage = dims.mesh(*CONTEXT_AXES, flat=True)  # the world without a pipeline
    divide = float(dims.shape.stage_world // dims.shape.tp if sequence_parallel else dims.shape.stage_world)
    for module in unit.modules():
        if not isinstance(module, MoE):
            continue
        if module.experts.ep_group is not None:
            holders = dims.mesh(*EXPERT_PEERS, "tp", flat=True)
            _fully_shard_summed(module.experts, holders, divide, fully_shard, fsdp_options)
        _fully_shard_summed(module, stage, divide, fully_shard, fsdp_options)


def route_over_sequence_slices(model: torch.nn.Module, group: Any) -> None:
    """Sequence parallelism: each MoE layer of ``model`` sees this tp rank's positions only; its routing statistics
    (the balance and z losses' means, the loads) are taken over the positions of every rank of ``group``, as one
    process takes them over the whole sequence."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.sequence_group = group


def _fully_shard_summed(
    module: torch.nn.Module, mesh: Any, divide: float, fully_shard: Any, fsdp_options: Dict[str, Any]
) -> None:
    """``fully_shard`` over ``mesh`` (1-D, or HSDP's 2-D (replicate, shard)), the gradient summed over it then
    divided by ``divide``."""
    fully_shard(module, mesh=mesh, **fsdp_options)
    module.set_gradient_divide_factor(divide)
    # gloo has no pre-multiplied sum for the reduce-scatter: sum, then divide; over one shard rank FSDP2 divides
    # while copying (then, under HSDP, all-reduces a sum), and a forced sum would divide twice
    shard = mesh.ndim - 1
    if mesh.size(shard) > 1 and torch.distributed.get_backend(mesh.get_group(shard)) == "gloo":
        module.set_force_sum_reduction_for_comms(True)


def placed_parameters(model: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The parameters of every placed expert stack (FSDP2's DTensors once sharded)."""
    return [param for _fqn, _module, param in _placed(model)]


def placed_names(model: torch.nn.Module) -> List[str]:
    """The names of the placed expert stacks' parameters in ``model`` as it is (wrappers included): what DDP is
    told to leave out of its all-reduce."""
    return [
        f"{prefix}.{name}"
        for prefix, module in model.named_modules()
        if isinstance(module, GroupedExperts) and module.ep_group is not None
        for name in module.STACKS
    ]


class ExpertGradients:
    """The placed experts' gradients: summed over the ranks holding the same experts after the update's last
    micro-batch (``enabled``, set by the strategy's ``grad_sync``; ``reduce=False``: FSDP2 reduce-scatters them
    itself), and their part of the global norm."""

    def __init__(self, params: List[torch.nn.Parameter], dims: ParallelDims, reduce: bool = True):
        from toolkit.distributed.strategies import GradAllReduce

        self.reducer = GradAllReduce(params, dims.shape.world, group=dims.group(*EXPERT_PEERS)) if reduce else None
        self.ep_group = dims.group("ep")
        self.ids = {id(p) for p in params}

    @property
    def enabled(self) -> bool:
        return self.reducer is not None and self.reducer.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        if self.reducer is not None:
            self.reducer.enabled = value

    def global_norm(self, params: List[torch.nn.Parameter]) -> float:
        return global_grad_norm(params, self.ids, self.ep_group)

    def norm_of(self, dense_squares: torch.Tensor, expert_squares: torch.Tensor) -> float:
        """The global norm from this rank's squares (float64 scalars: the dense ones as every rank has them, its
        experts' own), the experts' added over the ep ranks (collective; ``--overlap-offload-step`` sums them
        during backward)."""
        return add_expert_squares(dense_squares, expert_squares, self.ep_group)


def add_expert_squares(dense: torch.Tensor, experts: torch.Tensor, ep_group: Any) -> float:
    """sqrt(dense + the experts' squares summed over the ep ranks): each ep rank holds other experts."""
    torch.distributed.all_reduce(experts, group=ep_group)
    return float((dense + experts).sqrt())


def global_grad_norm(params: List[torch.nn.Parameter], expert_ids: Set[int], ep_group: Any) -> float:
    """The L2 norm of all gradients of the model: the replicated ones once, each expert shard's squares added
    over the ep ranks (each holds other experts), so every rank measures, and clips by, the same norm."""
    from toolkit.core.dtensor import is_dtensor
    from toolkit.optim.grad_norm import sum_of_squares, total_norm

    dense_grads = [p.grad for p in params if id(p) not in expert_ids and p.grad is not None]
    expert_grads = [p.grad for p in params if id(p) in expert_ids and p.grad is not None]
    if any(is_dtensor(g) for g in dense_grads + expert_grads):  # FSDP2: each group summed over its own shards
        dense = total_norm(dense_grads).double().square()
        experts = total_norm(expert_grads).double().square()
    else:
        dense, experts = sum_of_squares(dense_grads), sum_of_squares(expert_grads).clone()
    return add_expert_squares(dense, experts, ep_group)


def _placed(model: torch.nn.Module):
    """(parameter name, its module, the parameter) of every placed expert stack."""
    for prefix, module in model.named_modules():
        if isinstance(module, GroupedExperts) and module.ep_group is not None:
            for name in module.STACKS:
                yield canonical_name(f"{prefix}.{name}"), module, getattr(module, name)


def gather_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Dict[str, Any]
) -> Dict[str, Any]:
    """An optimizer state (a full one: rank 0's, other ranks may hold none; or this rank's) with the expert moments
    replaced by whole stacks, gathered from every rank's optimizer (collective: every rank calls it). New entries:
    a local state's entries are the optimizer's own dicts."""
    for fqn, module, param in _placed(model):
        whole = _whole_entry(module, optimizer.state.get(param, {}))
        if fqn in state.get("state", {}):
            state["state"][fqn] = {**state["state"][fqn], **whole}
    return state


def _whole_entry(module: GroupedExperts, entry: Dict[str, Any]) -> Dict[str, Any]:
    """One expert stack's optimizer entry with every per-expert tensor gathered whole (collective)."""
    scaled = [key for key in entry if f"{key}_scale" in entry]
    whole = {
        k: module.whole_stack(v) if isinstance(v, torch.Tensor) else v for k, v in entry.items() if k not in scaled
    }
    for key in scaled:
        whole[key], whole[f"{key}_scale"] = _on_common_scale(module, entry[key], entry[f"{key}_scale"])
    return whole


def _on_common_scale(module: GroupedExperts, moment: torch.Tensor, scale: torch.Tensor):
    """cpu_adam's ``--fp16-adam-stats``: an fp16 moment over one scale per tensor, the rank's own experts' amax;
    stacked as they are, the others' halves would be read with this rank's scale. The whole stack goes over the
    largest scale of the ep ranks, the one a single process (the whole stack's amax) would hold, up to fp16
    rounding: (the fp16 moment, its scale)."""
    true = module.whole_stack(moment.float() * scale)
    common = scale.detach().clone().float()
    torch.distributed.all_reduce(common, op=torch.distributed.ReduceOp.MAX, group=module.ep_group)
    return (true / common).to(moment.dtype), common.to(scale.dtype)


def own_optimizer_state(model: torch.nn.Module, state: Dict[str, Any]) -> Dict[str, Any]:
    """A full optimizer state with the expert moments cut to this rank's experts."""
    for fqn, module, _param in _placed(model):
        entry = state.get("state", {}).get(fqn)
        if entry:
            state["state"][fqn] = {
                key: module.own_part(value) if isinstance(value, torch.Tensor) else value
                for key, value in entry.items()
            }
    return state
