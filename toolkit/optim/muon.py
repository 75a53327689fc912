"""``--optimizer muon``: Newton-Schulz-orthogonalized momentum for the blocks' matrices, AdamW for the rest.

One optimizer over parameter groups tagged with the family's roles (``toolkit.optim.param_groups``): groups of
role ``matrix`` take torch's Muon update (``torch.optim.Muon``'s momentum, Newton-Schulz iteration and
learning-rate adjustment, the same functions), every other group (embeddings, output head, norms, biases)
takes torch's AdamW update. One optimizer, so one state dict, one LR schedule (``set_lr`` sets every group;
the AdamW side keeps its ratio ``--muon-adamw-lr / --lr``) and the checkpoints' optimizer entry as for Adam:
Muon's parameters hold ``momentum_buffer`` (torch's name), AdamW's ``step``/``exp_avg``/``exp_avg_sq``.

Sharded matrices (FSDP2's row shards, tensor parallelism's column or row shards, both: DTensors):
orthogonalizing a shard is not orthogonalizing the matrix, so each matrix's momentum update is gathered
whole (``full_tensor``), orthogonalized by one owner, chosen round-robin (on a 2-D mesh the ranks at that
coordinate of the first dimension: ``distribute_tensor`` scatters dimension by dimension), and the owner's result is
scattered back as the parameter's own shards (``distribute_tensor(src_data_rank=owner)``). Every rank then
applies the same update to its shard, so N ranks take the step one process takes. The bytes moved per step
are logged once at start-up.

Host memory (``--cpu-offload``: the parameters, gradients and this state live on the CPU): the momentum stays
there (fp32, or bf16 with ``--muon-momentum-dtype bf16``); the Newton-Schulz iteration runs on the GPU when
there is one, else on the CPU. On the GPU the transfers overlap the work (``HostStaging``, ``pipelined``): each
update goes up in bf16 through pinned buffers on a side stream while the previous matrix iterates, and comes
back the same way while the next one computes; the host applies results in order.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional

import torch
from torch.optim.adamw import adamw
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr, _zeropower_via_newtonschulz

from toolkit.config.components import MOMENTUM_DTYPES as MOMENTUM_DTYPE_NAMES, MuonConfig  # noqa: F401  (its options, torch-free for --help)
from toolkit.core.dtensor import is_dtensor
from toolkit.core.errors import UserError
from toolkit.core.registry import OptimizerState, ParameterPiece, register_optimizer
from toolkit.optim.adam import adamw_state_bytes, check_adam_options

logger = logging.getLogger("toolkit.optim")

MOMENTUM_DTYPES = dict(zip(MOMENTUM_DTYPE_NAMES, (torch.float32, torch.bfloat16)))


def newton_schulz(matrix: torch.Tensor, ns_steps: int) -> torch.Tensor:
    """torch.optim.Muon's orthogonalization of one whole matrix (its coefficients; the result in bf16); a stack
    [E, A, B] (a MoE layer's experts) is E matrices, each orthogonalized on its own."""
    if matrix.dim() == 3:
        return torch.stack([newton_schulz(m, ns_steps) for m in matrix])
    return _zeropower_via_newtonschulz(matrix, (DEFAULT_A, DEFAULT_B, DEFAULT_C), ns_steps, EPS)


def pipelined(tasks: Iterable, start: Callable, finish: Callable, depth: int) -> None:
    """``finish(task, start(task))`` for every task in order, with up to ``depth`` started tasks not yet finished.

    ``start`` launches a task's asynchronous work (the GPU's copies and Newton-Schulz) and returns a handle;
    ``finish`` waits on it and consumes the result. With ``depth`` 1 the host prepares and launches matrix i+1
    while the GPU still works on matrix i; with ``depth`` 0 every task finishes before the next starts (the
    CPU path: the same operations in the same order as a plain loop)."""
    in_flight: Deque = deque()
    for task in tasks:
        in_flight.append((task, start(task)))
        if len(in_flight) > depth:
            finish(*in_flight.popleft())
    while in_flight:
        finish(*in_flight.popleft())


class HostStaging:
    """Pinned host buffers and two copy streams: the offloaded step's transfers overlap the GPU's Newton-Schulz.

    A matrix's update goes up in bf16 (Newton-Schulz's first operation is that cast, so the numbers are the
    same and the bytes half) through a pinned buffer on the upload stream, which waits for nothing the compute
    stream does: matrix i+1 goes up while matrix i iterates. Its result comes back through another pinned buffer
    on the download stream, which waits for the compute stream's work so far (that matrix's iteration), while
    the compute stream goes on with the next one. Buffers are kept per (slot, direction, shape); the caller gives
    task i the slot i mod (depth + 1), so a slot is written again only after the task that last used it has
    finished (its download waited on, which came after its upload and its compute)."""

    def __init__(self, slots: int):
        self.slots = slots
        self.up, self.down = torch.cuda.Stream(), torch.cuda.Stream()
        self._buffers: Dict[tuple, torch.Tensor] = {}

    def _pinned(self, slot: int, direction: str, shape: torch.Size) -> torch.Tensor:
        key = (slot, direction, tuple(shape))
        if key not in self._buffers:
            self._buffers[key] = torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)
        return self._buffers[key]

    def upload(self, host: torch.Tensor, slot: int) -> torch.Tensor:
        """``host`` on the GPU in bf16; the compute stream waits for the copy."""
        staged = self._pinned(slot, "up", host.shape)
        staged.copy_(host)
        compute = torch.cuda.current_stream()
        with torch.cuda.stream(self.up):  # allocated and written on the upload stream
            device = torch.empty(host.shape, dtype=torch.bfloat16, device="cuda")
            device.copy_(staged, non_blocking=True)
        compute.wait_stream(self.up)
        device.record_stream(compute)  # read there: not reused before the compute stream is done with it
        return device

    def download(self, device: torch.Tensor, slot: int) -> Callable[[], torch.Tensor]:
        """Starts copying ``device`` (bf16, made on the compute stream) back; returns the wait that hands over
        the host copy."""
        host = self._pinned(slot, "down", device.shape)
        self.down.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.down):
            host.copy_(device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.down)

        def wait(keep_alive: torch.Tensor = device) -> torch.Tensor:  # the GPU copy lives until it is copied
            done.synchronize()
            return host

        return wait


def start_orthogonalization(
    update: torch.Tensor, ns_steps: int, owner: int, staging: Optional[HostStaging] = None, slot: int = 0
) -> Callable[[], torch.Tensor]:
    """Newton-Schulz of the whole matrix ``update``; returns the wait that gives the result (of a DTensor: this
    rank's shard, where the update's shard lies).

    A DTensor is gathered whole, orthogonalized where the first mesh coordinate is ``owner`` and scattered
    back from there. Under ``--cpu-offload`` on a GPU (``staging``) the update (a plain matrix, or a DTensor's
    host shard) goes up through ``staging``, the gather, iteration and scatter run on the GPU, and the result
    comes back through ``staging``: all launched here, waited for by the returned function. Without a GPU
    everything runs here, on the update's device."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(update, DTensor):
        if staging is None:
            result = newton_schulz(update, ns_steps)
            return lambda: result
        return staging.download(newton_schulz(staging.upload(update, slot), ns_steps), slot)
    mesh, placements, home = update.device_mesh, update.placements, update.to_local().device
    if staging is not None or home.type != mesh.device_type:  # host shards, collectives on the mesh's device
        local = staging.upload(update.to_local(), slot) if staging is not None else update.to_local()
        update = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=update.shape, stride=update.stride()
        )
    full = update.full_tensor()
    if mesh.get_coordinate()[0] == owner:
        result = newton_schulz(full, ns_steps)
    else:  # filled by the owner's scatter
        result = torch.empty(full.shape, dtype=torch.bfloat16, device=full.device)
    shard = distribute_tensor(result, mesh, placements, src_data_rank=owner).to_local()
    if staging is not None:
        return staging.download(shard, slot)
    shard = shard.to(home)
    return lambda: shard


def orthogonalized_update(update: torch.Tensor, ns_steps: int, owner: int) -> torch.Tensor:
    """``start_orthogonalization`` waited for at once, on the update's device."""
    return start_orthogonalization(update, ns_steps, owner)()


def _shard(p: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the plain tensor itself."""
    return p.to_local() if is_dtensor(p) else p


def needs_staging(p: torch.Tensor) -> bool:
    """A matrix in host memory (``--cpu-offload``) whose Newton-Schulz can run on a GPU: a plain tensor, or a
    DTensor whose mesh (its collectives) is on the GPU."""
    local = _shard(p)
    mesh = getattr(p, "device_mesh", None)
    return local.device.type == "cpu" and torch.cuda.is_available() and (mesh is None or mesh.device_type == "cuda")


class Muon(torch.optim.Optimizer):
    """Muon on the groups of role ``matrix``, AdamW on the others (see the module docstring)."""

    def __init__(
        self,
        params: List[Dict[str, Any]],
        lr: float,
        *,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr_fn: str = "original",
        adamw_lr_ratio: float = 1.0,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum_dtype: torch.dtype = torch.float32,
    ):
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            betas=tuple(betas),
            eps=eps,
            lr_ratio=adamw_lr_ratio,
        )
        super().__init__(params, defaults)
        self.momentum_dtype = momentum_dtype
        self.pipeline_depth = 1  # matrices in flight on the GPU under --cpu-offload (see _muon_group)
        self._staging: Optional[HostStaging] = None  # created at the first offloaded step on a GPU
        for group in self.param_groups:
            if group["role"] == "matrix":
                group["lr_ratio"] = 1.0
                for p in group["params"]:
                    if p.dim() not in (2, 3):
                        raise ValueError(
                            f"--optimizer muon: a 'matrix' parameter has shape {tuple(p.shape)}; "
                            "the family's parameter_roles must name only 2-D weights (or stacks "
                            "of them, [experts, out, in]) 'matrix'"
                        )
        self._log_communication()
        self.register_load_state_dict_post_hook(Muon._momentum_in_own_dtype)

    @staticmethod
    def _momentum_in_own_dtype(optimizer: Muon) -> None:
        """torch's ``load_state_dict`` casts state to the parameter's dtype: a checkpoint's momentum (fp32 or bf16)
        is converted to this run's ``--muon-momentum-dtype``, as cpu_adam converts its moments."""
        for state in optimizer.state.values():
            buf = state.get("momentum_buffer")
            if buf is not None and buf.dtype != optimizer.momentum_dtype:
                state["momentum_buffer"] = buf.to(optimizer.momentum_dtype)

    def _matrices(self) -> List[torch.Tensor]:
        return [p for g in self.param_groups if g["role"] == "matrix" for p in g["params"]]

    def _log_communication(self) -> None:
        """Once at start-up: how many bytes the whole-matrix orthogonalization moves per step."""
        from torch.distributed.tensor import DTensor

        sharded = [p for p in self._matrices() if isinstance(p, DTensor)]
        if not sharded:
            return
        mesh = sharded[0].device_mesh
        rank, world = torch.distributed.get_rank(), mesh.size()
        gathered = sum(p.numel() - p.to_local().numel() for p in sharded) * 4  # fp32 momentum in
        scattered = sum(p.numel() for p in sharded) * 2 // world  # bf16 result out, from owners in turn
        if rank == 0:
            logger.info(
                f"--optimizer muon: {len(sharded)} sharded matrices orthogonalized whole, each by one "
                f"owner (round-robin over {min(mesh.shape)} ranks): per step a rank gathers "
                f"{gathered / 2**20:.2f} MiB of momentum and receives {scattered / 2**20:.2f} MiB of "
                f"updates"
            )

    def _momentum(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=self.momentum_dtype)
        return state["momentum_buffer"]

    def _momentum_update(self, group: Dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        """torch.optim.Muon's momentum step for ``p``; returns the (Nesterov) update to orthogonalize."""
        momentum, grad, buf = group["momentum"], p.grad, self._momentum(p)
        if buf.dtype != grad.dtype:  # bf16 momentum: the arithmetic in the gradient's precision
            wide = buf.to(grad.dtype).lerp_(grad, 1 - momentum)
            buf.copy_(wide)
        else:
            wide = buf.lerp_(grad, 1 - momentum)
        return grad.lerp(wide, momentum) if group["nesterov"] else wide

    def _muon_group(self, group: Dict[str, Any], first_index: int) -> int:
        """torch.optim.Muon's single-tensor update with whole-matrix orthogonalization; returns the next index.

        Host-memory matrices on a machine with a GPU go through ``pipelined``: matrix i+1's momentum step and
        upload are launched while matrix i iterates, and i's result is applied once it is back."""
        tasks, index = [], first_index
        for p in group["params"]:
            owner = index % self._owners(p)
            index += 1
            if p.grad is not None:
                tasks.append((len(tasks), p, owner))
        staged = bool(tasks) and needs_staging(tasks[0][1])
        depth = self.pipeline_depth if staged else 0
        if staged and self._staging is None:
            self._staging = HostStaging(slots=self.pipeline_depth + 1)

        def start(task):
            i, p, owner = task
            update = self._momentum_update(group, p)
            return start_orthogonalization(
                update, group["ns_steps"], owner, self._staging if staged else None, slot=i % (depth + 1)
            )

        def finish(task, wait):
            _, p, _ = task
            lr, update = group["lr"], wait()
            local = _shard(p)  # where the update belongs
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape[-2:]))

        pipelined(tasks, start, finish, depth)
        return index

    @staticmethod
    def _owners(p: torch.Tensor) -> int:
        """How many owners take turns: ``distribute_tensor`` scatters from the same group rank on every mesh
        dimension, so an owner is a rank index all of them have."""
        mesh = getattr(p, "device_mesh", None)
        return min(mesh.shape) if mesh is not None else 1

    def _adamw_group(self, group: Dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            foreach=False,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"] * group["lr_ratio"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            if group["role"] == "matrix":
                index = self._muon_group(group, index)
            else:
                self._adamw_group(group)
        return loss


def check_muon_options(cfg: MuonConfig, lr: float) -> float:
    """The options' checks; returns the AdamW side's learning rate as a ratio of --lr."""
    check_adam_options(cfg, lr)
    if not 0.0 <= cfg.muon_momentum < 1.0:
        raise UserError(f"--muon-momentum: must be in [0, 1), got {cfg.muon_momentum}")
    if cfg.muon_adamw_lr is None:
        return 1.0
    if cfg.muon_adamw_lr < 0:
        raise UserError(f"--muon-adamw-lr: must be >= 0, got {cfg.muon_adamw_lr}")
    if lr == 0:
        raise UserError("--muon-adamw-lr: is scheduled as a ratio of --lr, which is 0; give --lr > 0")
    return cfg.muon_adamw_lr / lr


def _state_bytes(options: MuonConfig, piece: ParameterPiece) -> int:
    """One momentum per matrix (no step counter), in --muon-momentum-dtype; AdamW's state on the other roles."""
    if piece.role == "matrix":
        return MOMENTUM_DTYPES[options.muon_momentum_dtype].itemsize * piece.local_numel
    return adamw_state_bytes(options, piece)


MUON_STATE = OptimizerState(_state_bytes, lambda options: f"muon (momentum {options.muon_momentum_dtype}) + adamw")


@register_optimizer("muon", dataclass=MuonConfig, state=MUON_STATE)
def build(cfg: MuonConfig, params: list, lr: float) -> torch.optim.Optimizer:
    ratio = check_muon_options(cfg, lr)
    params = list(params)
    if not all(isinstance(g, dict) and "role" in g for g in params):
        raise UserError(
            "--optimizer muon: needs the parameters grouped by the family's roles (matrices for Muon, "
            "the rest for AdamW); build it from toolkit.optim.param_groups.parameter_groups"
        )
    return Muon(
        params,
        lr,
        momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov,
        ns_steps=cfg.muon_ns_steps,
        adjust_lr_fn=cfg.muon_adjust_lr,
        adamw_lr_ratio=ratio,
        betas=check_adam_options(cfg, lr),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        momentum_dtype=MOMENTUM_DTYPES[cfg.muon_momentum_dtype],
    )
