"""The run's parallel layout, built once from the flags: every mesh and group comes from here (torchtitan's ``ParallelDims``).

The world of W ranks is laid out as ``(pp, dp_replicate, dp_shard, cp, tp)``, pipeline stages outermost (the
stages exchange one activation per micro-batch, the cheapest traffic, so they may span machines) and tensor
parallelism innermost (consecutive ranks, one machine), and nothing else in the toolkit builds a DeviceMesh or a
process group:

=================  ===========================================  ===============================================
axis               flag                                         what the ranks along it share
=================  ===========================================  ===============================================
``pp``             ``--pipeline-parallel-size``                 one batch, each rank the layers of its stages
``dp_replicate``   ``--sharding-strategy no_shard|hybrid_*``    nothing: each holds a whole (or hybrid) replica
``dp_shard``       ``--ddp-backend fully_sharded``,             FSDP2 shards parameters over ``dp_shard x cp``
                   ``--shard-group-size`` (hybrid)
``cp``             ``--context-parallel-size``                  one batch, each rank a chunk of the sequence
``tp``             ``--model-parallel-size``                    one batch, each rank a slice of every block
``ep``             ``--expert-parallel-size``                   carved from ``dp_shard x cp`` (below)
=================  ===========================================  ===============================================

Every other axis lives inside one pipeline stage: its meshes are the stage's (``dims.mesh(*DP_AXES)`` spans the
data ranks of this rank's stage), and ``dims.group("pp")`` joins the ranks holding the same place in each stage.

Data: the batches are sharded over ``dp_replicate x dp_shard`` (:attr:`ParallelDims.data_rank`,
:attr:`~ParallelDims.data_world`); the CP and TP ranks of one replica read the same batch. Losses, token
counts and gradients not reduced by FSDP2 are summed over ``dp_replicate x dp_shard x cp`` (the ranks
holding the same TP slice: ``dims.group(*DP_AXES)``), whose size divides the summed gradient.

Expert parallelism (as torchtitan and Megatron): the experts of a MoE layer are spread over ``ep`` ranks
taken from the ranks that shard one replica (``ep`` divides ``dp_shard x cp``, consecutive ranks of it),
so an expert's tokens come from that many data-parallel ranks and no rank is set aside for experts only;
the dense layers keep their ``dp_shard x cp`` sharding. Under FSDP2 each rank's experts are sharded over the
(dp_shard x cp) / ep ranks holding the same ones (``dims.mesh(*EXPERT_PEERS)``, torchtitan's ``dp_shard_mod_ep``),
so their gradients are reduce-scattered among those ranks only. Under HSDP
(hybrid_*, no_shard) those ranks span the replica groups: the experts' mesh is 2-D, (ep_replicate, ep_shard), the
dense layers' (dp_replicate, dp_shard) with ep carved out of the shard axis (torchtitan's ``dp_mod_ep``); under
no_shard the ep ranks are whole replicas (carved from ``dp_replicate x cp``, as under DDP). Under tensor
parallelism the experts are not split over tp: ``ep`` divides all the data-parallel ranks (world / tp), each tp
rank holds its experts whole, and FSDP2 shards them over the ranks holding the same ones, their ep peers of
every tp rank (``dims.mesh(*EXPERT_PEERS, "tp", flat=True)``).

:func:`parallel_shape` is the validation, a pure function of sizes (no process group): ``toolkit-train``
(``train/resolve.py``, before any rank starts) and ``toolkit-plan`` both call it, so the planner refuses
the layouts training refuses. :class:`ParallelDims` builds the meshes from a shape once, on first use, as
views of one world mesh (``DeviceMesh._unflatten``), so FSDP2's and TP's meshes share their root, and hands
them out by axis names (``dims.mesh("tp")``, ``dims.group("cp")``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from toolkit.config import DistributedConfig
from toolkit.core.errors import UserError

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "hybrid_shard_zero2")
BACKEND_ALIASES = {"pytorch_ddp": "c10d", "legacy_ddp": "no_c10d"}
TP = "tp"
AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
MESH_AXES = AXES + ("ep_replicate", "ep_shard", "world")  # what ParallelDims.mesh / group take
DP_AXES = ("dp_replicate", "dp_shard", "cp")  # the ranks holding the same TP slice: FSDP2's mesh, the loss sums
EXPERT_PEERS = ("ep_replicate", "ep_shard")  # the ranks holding the same experts (of one tp rank)
CONTEXT_AXES = ("dp_replicate", "dp_shard", "cp", TP)


@dataclass(frozen=True)
class ParallelShape:
    """Sizes of every axis (``pp x dp_replicate x dp_shard x cp x tp`` is the world; ``ep`` is carved from
    ``dp_shard x cp``)."""

    world: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    fsdp: bool = False  # FSDP2 wraps the model (--ddp-backend fully_sharded, or c10d under TP)
    hsdp: bool = False  # FSDP2's mesh has the dp_replicate axis (no_shard, hybrid_*; c10d under TP)

    @property
    def stage_world(self) -> int:
        """The ranks of one pipeline stage (the world when there is no pipeline)."""
        return self.world // self.pp

    @property
    def data_world(self) -> int:
        """Data-parallel replicas: how many distinct batches one step reads."""
        return self.dp_replicate * self.dp_shard

    @property
    def loss_world(self) -> int:
        """Ranks whose losses are summed (the same TP slice): replicas x context-parallel chunks."""
        return self.data_world * self.cp

    @property
    def fsdp_shard(self) -> int:
        """Ranks one parameter is sharded over (1: replicated)."""
        return self.dp_shard * self.cp if self.fsdp else 1

    @property
    def shard_axis(self) -> str:
        """The FSDP shard axis's name: ``dp_shard``, or ``dp_shard_cp`` when context parallelism shares it."""
        return "dp_shard" if self.cp == 1 else "dp_shard_cp"

    @property
    def expert_shard(self) -> int:
        """Ranks one expert's weights are sharded over by FSDP2: the (dp_shard x cp) / ep ranks of a replica holding
        the same experts, or 1 where the ep ranks are whole replicas (no_shard); the experts' FSDP2 mesh is
        (world / (ep x tp x expert_shard), expert_shard), replicated along the first axis under HSDP."""
        carved = self.dp_shard * self.cp
        return carved // self.ep if self.fsdp and carved % self.ep == 0 else 1

    def size(self, axis: str) -> int:
        """The size of a mesh axis (``MESH_AXES``, or ``dp_shard_cp``): ``ep_replicate x ep_shard`` are the
        world / (ep x tp) ranks holding the same experts, ``ep_shard`` those of them that shard them by FSDP2."""
        derived = dict(
            world=self.world,
            dp_shard_cp=self.dp_shard * self.cp,
            ep_replicate=self.stage_world // (self.ep * self.tp * self.expert_shard),
            ep_shard=self.expert_shard,
        )
        return derived[axis] if axis in derived else getattr(self, axis)

    @property
    def needs_mesh(self) -> bool:
        """DDP and ``no_c10d`` without TP/CP/EP use the default group only (no mesh, no extra groups)."""
        return self.fsdp or self.tp > 1 or self.cp > 1 or self.ep > 1 or self.pp > 1

    def data_rank(self, rank: int) -> int:
        """The batch shard of global ``rank`` (its CP and TP peers, and its peers of the other stages, read the same)."""
        return (rank % self.stage_world) // (self.cp * self.tp)

    def coordinates(self, rank: int) -> Dict[str, int]:
        """Global ``rank``'s index along each axis (``ep``: its place among the expert-parallel ranks)."""
        pp, rank = rank // self.stage_world, rank % self.stage_world
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        shard, replicate = rest % self.dp_shard, rest // self.dp_shard
        # ep: consecutive data-parallel ranks (ep divides dp_shard x cp, or every rank's data index under DDP)
        return dict(pp=pp, dp_replicate=replicate, dp_shard=shard, cp=cp, tp=tp, ep=(rank // self.tp) % self.ep)

    def placement(self, rank: int) -> str:
        """Global ``rank``'s index along each axis the layout splits (``""`` for plain data parallelism)."""
        where = self.coordinates(rank)
        return ", ".join(
            f"{axis} {where[axis]} of {getattr(self, axis)}"
            for axis in AXES
            if getattr(self, axis) > 1 and (axis != "dp_replicate" or self.hsdp)
        )

    def describe(self) -> str:
        sizes = [f"{name} {getattr(self, name)}" for name in AXES if name != "pp" or self.pp > 1]
        return f"{self.world} ranks = " + " x ".join(sizes[:-1]) + f" (ep {self.ep} of dp_shard x cp)"


def _positive(flag: str, value: int) -> int:
    if value < 1:
        raise UserError(f"{flag} {value}: must be >= 1 (1: no split along this axis)")
    return value


def parallel_shape(
    world: int,
    ddp_backend: str = "c10d",
    sharding_strategy: str = "full_shard",
    shard_group_size: int = 0,
    local_world_size: int = 0,
    tp: int = 1,
    cp: int = 1,
    ep: int = 1,
    pp: int = 1,
) -> ParallelShape:
    """The layout of ``world`` ranks for these flags, or a one-line UserError naming the axis that does not fit.

    Pure (no process group): ``toolkit-train`` checks it before spawning and ``toolkit-plan`` plans with it.
    ``local_world_size`` is the ranks of one machine; those of one stage are the default ``--shard-group-size`` of
    hybrid sharding.
    ``pp`` splits the world first; every other axis lays out the ranks of one stage.
    """
    pp = _positive("--pipeline-parallel-size", pp)
    if world % pp:
        raise UserError(
            f"--pipeline-parallel-size {pp}: must divide the world size {world} (each of the {pp} stages "
            f"gets world/{pp} ranks); give --distributed-world-size a multiple of {pp}"
        )
    full_world, world = world, world // pp
    backend = BACKEND_ALIASES.get(ddp_backend, ddp_backend)
    if sharding_strategy not in STRATEGIES:
        raise UserError(f"--sharding-strategy {sharding_strategy}: choose from {', '.join(STRATEGIES)}")
    tp, cp, ep = (
        _positive(flag, v)
        for flag, v in (("--model-parallel-size", tp), ("--context-parallel-size", cp), ("--expert-parallel-size", ep))
    )
    if world < tp:
        raise UserError(
            f"--model-parallel-size {tp}: each layer is split over that many ranks and this run has "
            f"{world} process(es); give --distributed-world-size {tp} (or a multiple), or start that "
            f"many ranks with torchrun"
        )
    if world % tp:
        raise UserError(
            f"--model-parallel-size {tp}: must divide the world size {world} (the world is split "
            f"into world/M data-parallel groups of M tensor-parallel ranks)"
        )
    if (world // tp) % cp:
        raise UserError(
            f"--context-parallel-size {cp}: must divide the {world // tp} ranks left by "
            f"--model-parallel-size {tp} of world size {world} (each replica's sequence is cut into "
            f"that many chunks)"
        )
    dp = world // (tp * cp)
    fsdp = backend == "fully_sharded" or (tp > 1 and backend != "no_c10d")  # no_c10d under TP: its own all-reduce
    strategy = sharding_strategy if backend == "fully_sharded" else "no_shard"
    if not fsdp or strategy == "no_shard":
        replicate, shard = dp, 1
    elif strategy.startswith("hybrid"):
        # the default: one machine's ranks of this stage (a machine may hold ranks of several stages)
        group = shard_group_size or max(1, min(local_world_size or world, world) // (tp * cp))
        if group < 1 or dp % group:
            raise UserError(
                f"--shard-group-size {group}: must divide the {dp} data-parallel ranks (world size "
                f"{world} / (--model-parallel-size {tp} x --context-parallel-size {cp})); ranks shard "
                f"within groups of this size and the groups replicate"
            )
        replicate, shard = dp // group, group
    else:
        replicate, shard = 1, dp
    _check_expert_axis(ep, world, tp, cp, replicate, shard, fsdp, strategy)
    return ParallelShape(
        world=full_world,
        pp=pp,
        dp_replicate=replicate,
        dp_shard=shard,
        cp=cp,
        tp=tp,
        ep=ep,
        fsdp=fsdp,
        hsdp=fsdp and strategy != "full_shard" and strategy != "shard_grad_op",
    )


def _check_expert_axis(
    ep: int, world: int, tp: int, cp: int, replicate: int, shard: int, fsdp: bool, strategy: str
) -> None:
    """--expert-parallel-size must divide the ranks the experts are spread over."""
    # DDP and no_shard: every data-parallel rank is a whole replica; FSDP2: the ranks that shard one replica; TP: every
    # data-parallel rank (the experts are whole on each tp rank, replicated over tp, and spread over ranks of
    # different batches)
    replicas = not fsdp or strategy == "no_shard"
    carved = replicate * shard * cp if tp > 1 else replicate * cp if replicas else shard * cp
    if carved % ep:
        where = (
            f"left by --model-parallel-size {tp} (world {world} / {tp})"
            if tp > 1
            else "that replicate the model (DDP, no_shard)"
            if replicas
            else f"that shard one replica (dp_shard {shard} x --context-parallel-size {cp})"
        )
        raise UserError(
            f"--expert-parallel-size {ep}: must divide the {carved} ranks {where}; experts are spread over those ranks"
        )


def shape_from_config(cfg: DistributedConfig, world: int, local_world_size: int = 0) -> ParallelShape:
    """:func:`parallel_shape` of a run's ``DistributedConfig`` on ``world`` ranks."""
    return parallel_shape(
        world,
        cfg.ddp_backend,
        cfg.sharding_strategy,
        cfg.shard_group_size,
        local_world_size,
        tp=cfg.model_parallel_size,
        cp=cfg.context_parallel_size,
        ep=cfg.expert_parallel_size,
        pp=cfg.pipeline_parallel_size,
    )


def check_expert_share(ep: int, experts: int) -> None:
    """Expert parallelism gives each of the ``ep`` ranks the same number of a layer's experts (the all-to-all
    exchanges equal blocks), so ``ep`` must divide them: toolkit-train checks the config, toolkit-plan the
    built model (an imported family names its expert count its own way)."""
    if ep > 1 and experts and experts % ep:
        raise UserError(
            f"--expert-parallel-size {ep}: each rank keeps an equal share of a layer's {experts} "
            f"experts (--moe-num-experts); give a divisor of {experts}"
        )


class ParallelDims:
    """A :class:`ParallelShape` placed on this rank, with its DeviceMesh and groups (built once, on first use).

    Every consumer asks for a mesh or a group by axis names (torchtitan's ``get_mesh``):
    ``dims.mesh("tp")``, ``dims.mesh(*DP_AXES)`` (FSDP2's 1-D or (replicate, shard) mesh),
    ``dims.group("cp")``, ``dims.group(*DP_AXES)`` (the sum of the losses), ``dims.mesh(*EXPERT_PEERS)`` (the
    experts' FSDP2 mesh), ``dims.mesh(*EXPERT_PEERS, "tp", flat=True)`` (their holders under TP),
    ``dims.mesh("world")``. ``dp_shard`` and ``cp`` asked for together are FSDP2's one shard axis
    (``dp_shard_cp``: FSDP2 shards over their product). An axis of size 1 that the layout leaves out is left out of
    the answer, so one spelling serves every layout; asking only for such axes is a ValueError naming them.

    Every rank must ask at the same point (building a mesh or flattening one is a collective); ``parallelize``
    builds them all for the run. Without a mesh (``needs_mesh`` False) the groups are the default one.
    """

    def __init__(self, shape: ParallelShape, rank: int = 0, device_type: str = "cpu"):
        self.shape, self.rank, self.device_type = shape, rank, device_type
        self._views: Optional[Dict[str, Any]] = None
        self._flat: Dict[Tuple[str, ...], Any] = {}

    @classmethod
    def from_config(cls, cfg: DistributedConfig, env: Any) -> ParallelDims:
        """The layout of the run: ``env`` is its ``DistributedEnv`` (rank, world, ranks per machine, device)."""
        shape = shape_from_config(cfg, env.world_size, env.local_world_size)
        return cls(shape, env.rank, env.device.type)

    @classmethod
    def single(cls) -> ParallelDims:
        """One process: every size 1, no mesh."""
        return cls(ParallelShape(world=1))

    # --- what a collective or the data loader asks (no mesh needed) ---------------------------

    @property
    def data_rank(self) -> int:
        return self.shape.data_rank(self.rank)

    @property
    def stage_world(self) -> int:
        """The ranks of one pipeline stage (the world when there is no pipeline)."""
        return self.world // self.pp

    @property
    def data_world(self) -> int:
        return self.shape.data_world

    @property
    def loss_world(self) -> int:
        return self.shape.loss_world

    # --- meshes and groups, by axis names -----------------------------------------------------

    def mesh(self, *axes: str, flat: bool = False) -> Any:
        """The DeviceMesh over ``axes`` (in that order); ``flat``: one axis over the ranks they span together
        (the whole world's mesh when they span every rank)."""
        view, names = self._locate(axes)
        if names == view.mesh_dim_names and (len(names) == 1 or not flat):
            return view
        if len(names) == 1:
            return view[names[0]]
        if not flat:
            return view[names]
        if math.prod(self.shape.size(name) for name in names) == self.shape.world:
            return self._built()["world"]
        if names not in self._flat:
            self._flat[names] = view[names]._flatten("_".join(names))
        return self._flat[names]

    def group(self, *axes: str) -> Any:
        """The process group of the ranks ``axes`` span together: what a sum over those ranks is given. None (the
        default group) where the layout has no mesh and they span every rank (DDP, one process)."""
        spans_world = math.prod(self.shape.size(axis) for axis in _known(axes)) == self.shape.world
        if spans_world and not self.shape.needs_mesh:
            return None
        return self.mesh(*axes, flat=True).get_group()

    def _locate(self, axes: Tuple[str, ...]) -> Tuple[Any, Tuple[str, ...]]:
        """The built mesh holding the most of ``axes`` (those of size 1 it leaves out aside) and their names in it."""
        wanted = list(_known(axes))
        if self.shape.cp > 1 and "dp_shard" in wanted and "cp" in wanted:  # FSDP2's shard axis: one axis
            wanted[wanted.index("dp_shard")] = "dp_shard_cp"
            wanted.remove("cp")
        found: Tuple[Any, Tuple[str, ...]] = (None, ())
        for view in self._built().values():
            names = view.mesh_dim_names
            inside = tuple(axis for axis in wanted if axis in names)
            if len(inside) > len(found[1]) and all(axis in names or self.shape.size(axis) == 1 for axis in wanted):
                found = (view, inside)
        if found[0] is None:
            raise ValueError(f"the layout has no {' x '.join(axes)} axis ({self.shape.describe()})")
        return found

    def _built(self) -> Dict[str, Any]:
        if self._views is None:
            self._views = _build_meshes(self.shape, self.device_type)
            for axes in _shared_groups(self.shape):  # asked for by every rank later, made here at once
                self.mesh(*axes, flat=True)
        return self._views

    def __repr__(self) -> str:
        return f"ParallelDims({self.shape.describe()}, rank {self.rank}: {self.shape.coordinates(self.rank)})"


def _known(axes: Tuple[str, ...]) -> Tuple[str, ...]:
    unknown = [axis for axis in axes if axis not in MESH_AXES]
    if unknown or not axes:
        raise ValueError(f"mesh axes {list(axes)}: choose from {', '.join(MESH_AXES)}")
    return axes


def _shared_groups(s: ParallelShape) -> List[Tuple[str, ...]]:
    """The flattened groups this layout's run sums over (losses; the experts' gradients and their holders)."""
    groups = [DP_AXES] if s.loss_world < s.world else []
    if s.pp > 1:  # a stage's ranks: its MoE layers' FSDP2 mesh under TP, their routers' token counts
        groups.append(CONTEXT_AXES)
    if s.ep > 1:
        groups.append(EXPERT_PEERS + (("tp",) if s.tp > 1 else ()))
    return groups


def _axes(*axes: Tuple[str, int, bool]) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
    """(sizes, names) of the axes kept: those of size > 1 and those marked to keep at size 1."""
    kept = [(name, size) for name, size, keep in axes if size > 1 or keep]
    return tuple(size for _, size in kept), tuple(name for name, _ in kept)


def _build_meshes(s: ParallelShape, device_type: str) -> Dict[str, Any]:
    """Views of one world mesh (so FSDP2's and TP's meshes share a root), looked up in this order: the dense
    layers' ``(dp_replicate?, dp_shard[_cp], tp?)`` (the names earlier checkpoints' logs and the tests know:
    ``(W,)`` dp_shard, ``(R, S)``, ``(R, S, M)``, ``(D, M)``), the context split's ``(dp_replicate, dp_shard, cp,
    tp)``, the experts' ``(ep_replicate?, ep_shard, ep, tp?)``, and the world. The only place groups are made."""
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh(device_type, (s.world,), mesh_dim_names=("world",))
    replicate = s.hsdp or s.dp_replicate > 1
    dense = _axes(
        ("pp", s.pp, False),
        ("dp_replicate", s.dp_replicate, s.hsdp),
        (s.shard_axis, s.dp_shard * s.cp, s.fsdp or not replicate),
        (TP, s.tp, False),
    )
    views = dict(dense=world._unflatten(0, *dense))
    if s.cp > 1:
        views["context"] = world._unflatten(
            0, *_axes(*((name, s.size(name), name != "pp" or s.pp > 1) for name in ("pp",) + CONTEXT_AXES))
        )
    if s.ep > 1:
        # ep consecutive data-parallel ranks share one layer's experts; (ep_replicate, ep_shard): the ranks holding
        # the same ones, a (replicate, shard) mesh of their own under HSDP (torchtitan's dp_mod_ep)
        experts = _axes(
            ("pp", s.pp, False),
            ("ep_replicate", s.size("ep_replicate"), s.fsdp and s.hsdp and s.tp == 1),
            ("ep_shard", s.expert_shard, True),
            ("ep", s.ep, True),
            (TP, s.tp, False),
        )
        views["experts"] = world._unflatten(0, *experts)
    views["world"] = world
    return views


__all__ = [
    "DP_AXES",
    "EXPERT_PEERS",
    "ParallelDims",
    "ParallelShape",
    "parallel_shape",
    "shape_from_config",
    "STRATEGIES",
]
