"""``--optimizer cpu_adam``: DeepSpeed's vectorized CPU AdamW behind a torch-compatible optimizer.

``CPUAdam`` is a ``torch.optim.Optimizer`` over the *original* parameters (plain
tensors, or the DTensors of FSDP2) whose ``state`` has torch AdamW's layout
(``step`` a float32 scalar tensor, ``exp_avg``, ``exp_avg_sq`` shaped and placed like
the parameter), so its ``state_dict`` loads into ``torch.optim.AdamW`` and the other
way round, and ``torch.distributed.checkpoint.state_dict`` treats it like any other
optimizer.

DeepSpeed's op never sees a DTensor (handing it one crashes the process): it gets each
rank's local shards -- ``p.to_local()`` views that share storage with the DTensors,
cached once -- and before each step ``local.grad = p.grad.to_local()``.

``--fp16-adam-stats`` (fairseq's flag): DeepSpeed only keeps fp16 moments for fp16
parameters, so for fp32 (master) parameters the moments are stored as fp16 with one
fp32 scale per tensor (``exp_avg_scale``/``exp_avg_sq_scale``, fairseq's scheme):
before the update they are expanded to fp32 one tensor at a time, updated by
DeepSpeed's op, and stored back as ``fp16(x / scale)`` with
``scale = 1e-8 + max|x| / 65504`` (``max`` over the whole tensor, all-reduced across
the shards of a DTensor). Such a state_dict is not loadable by torch AdamW as is; a
plain fp32 AdamW/cpu_adam state_dict loads into an fp16-stats optimizer (and back).

``--adam-state-precision bf16|8bit``: moments in bf16 or blockwise 8 bits, updated a bounded
slice at a time (toolkit/optim/quantized_states.py, which documents the layouts); any saved
layout loads into any other, with one INFO line when it converts.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Tuple

import torch

from toolkit.core.dtensor import is_dtensor, local_tensor
from toolkit.core.errors import UserError
from toolkit.optim import fused_8bit, quantized_states
from toolkit.optim.adam import check_adam_options
from toolkit.optim.deepspeed_op import load_deepspeed_cpu_adam
from toolkit.core.registry import OptimizerState, ParameterPiece, register_optimizer
from toolkit.config.components import CPUAdamConfig  # its options, torch-free for --help

logger = logging.getLogger(__name__)

FLOAT16_MAX = 65504.0
_HYPER = ("lr", "betas", "eps", "weight_decay", "bias_correction")
# Elements per DeepSpeed call: 4 MiB of fp32 gradient stays in cache between its multiply and the update
# (and, with DeepSpeed's own binding, which keeps the GIL, other Python threads get it between calls).
_STEP_CHUNK = 1 << 20


# ---------------------------------------------------------------------------
# The optimizer
# ---------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor sharing storage with ``t`` (its local shard for a DTensor)."""
    with torch.no_grad():
        return local_tensor(t)


class CPUAdam(torch.optim.Optimizer):
    """AdamW on CPU through ``deepspeed.ops.adam.DeepSpeedCPUAdam`` (``adamw_mode=True``).

    Parameters may be plain CPU tensors or DTensors whose local shards are on the CPU
    (FSDP2 with ``--cpu-offload``). See the module docstring for the state layout.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        fp16_adam_stats: bool = False,
        adam_state_precision: str = "fp32",
    ):
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            amsgrad=False,
        )
        super().__init__(params, defaults)
        self.fp16_adam_stats = bool(fp16_adam_stats)
        self.moments = (
            None
            if adam_state_precision == "fp32"
            else quantized_states.ReducedMoments(adam_state_precision, fused=fused_8bit.update)
        )
        self._locals: Dict[torch.Tensor, torch.Tensor] = {}
        for group in self.param_groups:
            for p in group["params"]:
                self._locals[p] = self._check_and_view(p)
        DeepSpeedCPUAdam = load_deepspeed_cpu_adam()
        self._ds = DeepSpeedCPUAdam(
            [self._ds_group(g) for g in self.param_groups],
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            adamw_mode=True,
            fp32_optimizer_states=True,
        )

    # -- construction helpers ------------------------------------------------
    @staticmethod
    def _check_and_view(p: torch.Tensor) -> torch.Tensor:
        local = _local(p)
        if local.device.type != "cpu":
            raise UserError(
                f"--optimizer cpu_adam: parameters must live in host memory, found one on "
                f"{local.device}; use --cpu-offload (with --ddp-backend fully_sharded) or --cpu, "
                "or use --optimizer adam"
            )
        if local.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise UserError(
                f"--optimizer cpu_adam: unsupported parameter dtype {local.dtype} (float32, float16 or bfloat16)"
            )
        if not local.is_contiguous():
            # DeepSpeed's op updates a contiguous copy of a non-contiguous tensor: the update would be lost.
            raise ValueError("cpu_adam: parameter (local shard) is not contiguous")
        return local

    def _ds_group(self, group: Dict[str, Any]) -> Dict[str, Any]:
        out = {k: group[k] for k in _HYPER}
        out["params"] = [self._locals[p] for p in group["params"]]
        return out

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_ds"):  # after __init__: mirror it on DeepSpeed's side
            group = self.param_groups[-1]
            for p in group["params"]:
                self._locals[p] = self._check_and_view(p)
            self._ds.add_param_group(self._ds_group(group))

    # -- state ---------------------------------------------------------------
    def _init_state(self, p: torch.Tensor, state: Dict[str, Any]) -> None:
        # torch AdamW's layout: a float32 scalar step, moments shaped/placed like the param.
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        if self.moments is not None:
            state.update(self.moments.zeros(p))
            return
        dtype = torch.float16 if self.fp16_adam_stats else torch.float32
        state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if self.fp16_adam_stats:
            state["exp_avg_scale"] = torch.tensor(1.0)
            state["exp_avg_sq_scale"] = torch.tensor(1.0)

    def _local_grad(self, p: torch.Tensor) -> torch.Tensor:
        g = p.grad
        if is_dtensor(g):
            if tuple(g.placements) != tuple(p.placements):
                g = g.redistribute(p.device_mesh, p.placements)
            g = g.to_local()
        if g.dtype != self._locals[p].dtype:
            g = g.to(self._locals[p].dtype)
        return g.contiguous()

    # -- step ----------------------------------------------------------------
    # The gradient normalization (and clip coefficient) is folded into the step: each chunk of a
    # gradient is multiplied by ``grad_scale`` right before DeepSpeed's op reads it (cache-hot),
    # the same fp32 multiply as a separate ``_foreach_mul_`` pass, so the result is bit-identical.
    supports_grad_scale = True

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float = 1.0):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.run_step(self.plan_step(), grad_scale)
        return loss

    def plan_step(self) -> List[Tuple[torch.Tensor, Dict[str, Any]]]:
        """(parameter, its group's hyperparameters as they are now) for each parameter with a gradient.

        Taking the hyperparameters here lets ``run_step`` run later on another thread
        (``--overlap-offload-step``) while the LR schedule moves on. States are created here.
        """
        plan = []
        for group in self.param_groups:
            hyper = {k: group.get(k, self.defaults[k]) for k in _HYPER}
            hyper.update(
                lr=float(hyper["lr"]),
                eps=float(hyper["eps"]),
                weight_decay=float(hyper["weight_decay"]),
                betas=tuple(float(b) for b in hyper["betas"]),
            )
            for p in group["params"]:
                if p.grad is None:
                    continue
                if len(self.state[p]) == 0:
                    self._init_state(p, self.state[p])
                plan.append((p, hyper))
        return plan

    @torch.no_grad()
    def run_step(self, plan: List[Tuple[torch.Tensor, Dict[str, Any]]], grad_scale: float = 1.0) -> None:
        """Update the parameters of ``plan`` (all of ``plan_step``'s, or one block's), gradients times ``grad_scale``."""
        for p, hyper in plan:
            local, state = self._locals[p], self.state[p]
            self._prime_bias_correction(int(state["step"].item()) + 1, hyper)
            if self.moments is not None:  # --adam-state-precision bf16/8bit: a bounded slice at a time
                self.moments.update(self._ds, p, local, state, hyper, grad_scale)
                state["step"] += 1
                continue
            if local is not p:
                local.grad = self._local_grad(p)
            elif p.grad.dtype != p.dtype:
                raise ValueError("cpu_adam: gradient dtype differs from the parameter's")
            if self.fp16_adam_stats:
                if grad_scale != 1.0:
                    local.grad.mul_(grad_scale)
                self._fp16_stats_update(p, local, state, hyper)
            else:
                self._fp32_update(local, state, hyper, grad_scale)
            state["step"] += 1
            if local is not p:
                local.grad = None  # do not keep the gradient alive past zero_grad

    def _prime_bias_correction(self, step: int, hyper: Dict[str, Any]) -> None:
        """Make DeepSpeed compute ``beta ** step`` afresh for the next update, whatever was stepped before.

        Its op keeps ``beta ** step`` between calls and multiplies it by beta when the step
        grows by one, so the bias correction depended on the order of earlier calls (last-bit
        differences). A call on empty tensors at ``step + 2`` makes the next call at ``step``
        recompute the power: the update is the same in any order (block by block too).
        """
        empty = torch.empty(0)
        beta1, beta2 = hyper["betas"]
        self._ds.ds_opt_adam.adam_update(
            self._ds.opt_id,
            step + 2,
            hyper["lr"],
            beta1,
            beta2,
            hyper["eps"],
            hyper["weight_decay"],
            hyper["bias_correction"],
            empty,
            empty,
            empty,
            empty,
        )

    def _fp32_update(
        self, local: torch.Tensor, state: Dict[str, Any], hyper: Dict[str, Any], grad_scale: float
    ) -> None:
        """DeepSpeed's update, a chunk at a time (a multiple of its SIMD span: the same arithmetic per element)."""
        step = int(state["step"].item()) + 1
        beta1, beta2 = hyper["betas"]
        flat = [
            local.view(-1),
            local.grad.reshape(-1),
            _local(state["exp_avg"]).view(-1),
            _local(state["exp_avg_sq"]).view(-1),
        ]
        for start in range(0, flat[0].numel(), _STEP_CHUNK):
            param, grad, exp_avg, exp_avg_sq = (t[start : start + _STEP_CHUNK] for t in flat)
            if grad_scale != 1.0:
                grad.mul_(grad_scale)
            self._ds.ds_opt_adam.adam_update(
                self._ds.opt_id,
                step,
                hyper["lr"],
                beta1,
                beta2,
                hyper["eps"],
                hyper["weight_decay"],
                hyper["bias_correction"],
                param,
                grad,
                exp_avg,
                exp_avg_sq,
            )

    def _fp16_stats_update(self, p, local, state, group) -> None:
        """One tensor: expand fp16 moments, run DeepSpeed's op, store them back scaled (fairseq's scheme)."""
        if state["exp_avg"].dtype != torch.float16:
            self._quantize_state(p, state)
        ea16, eas16 = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        exp_avg = ea16.float().mul_(state["exp_avg_scale"])
        exp_avg_sq = eas16.float().mul_(state["exp_avg_sq_scale"])
        step = int(state["step"].item()) + 1
        beta1, beta2 = group["betas"]
        self._ds.ds_opt_adam.adam_update(
            self._ds.opt_id,
            step,
            group["lr"],
            beta1,
            beta2,
            group["eps"],
            group["weight_decay"],
            group["bias_correction"],
            local.data,
            local.grad.data,
            exp_avg,
            exp_avg_sq,
        )
        self._store_fp16(p, state, exp_avg, exp_avg_sq)

    def _store_fp16(self, p, state, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        amax = torch.stack(
            [
                exp_avg.abs().max() if exp_avg.numel() else exp_avg.new_zeros(()),
                exp_avg_sq.abs().max() if exp_avg_sq.numel() else exp_avg_sq.new_zeros(()),
            ]
        )
        if is_dtensor(p):
            amax = _all_reduce_max(amax, p.device_mesh)
        scales = amax / FLOAT16_MAX + 1e-8
        state["exp_avg_scale"] = scales[0].clone()
        state["exp_avg_sq_scale"] = scales[1].clone()
        _local(state["exp_avg"]).copy_(exp_avg.div_(scales[0]))
        _local(state["exp_avg_sq"]).copy_(exp_avg_sq.div_(scales[1]))

    def _quantize_state(self, p, state) -> None:
        """fp32 moments (e.g. from a torch AdamW state_dict) -> fp16 + scales."""
        ea, eas = state["exp_avg"], state["exp_avg_sq"]
        state["exp_avg"] = torch.zeros_like(ea, dtype=torch.float16)
        state["exp_avg_sq"] = torch.zeros_like(eas, dtype=torch.float16)
        self._store_fp16(p, state, _local(ea).float(), _local(eas).float())

    # -- state_dict interop ----------------------------------------------------
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        saved, state_dict = quantized_states.withhold_moments(self.param_groups, state_dict)  # from torch's casts
        conversions = set()
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for k in _HYPER:
                group.setdefault(k, self.defaults[k])
            group.setdefault("amsgrad", False)
            if group.get("amsgrad"):
                raise ValueError("cpu_adam: the loaded state uses AMSGrad, which DeepSpeed's CPU Adam lacks")
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                step = state.get("step")
                state["step"] = (
                    step.detach().to(device="cpu", dtype=torch.float32)
                    if torch.is_tensor(step)
                    else torch.tensor(float(step or 0), dtype=torch.float32)
                )
                state.pop("max_exp_avg_sq", None)
                if self.moments is not None:
                    conversions.add(self.moments.adopt(p, state, saved.get(p)))
                    continue
                found = quantized_states.to_fp32_state(p, state, saved.get(p))
                if found in ("8bit", "bf16"):
                    conversions.add((found, "fp16" if self.fp16_adam_stats else "fp32"))
                has_scales = "exp_avg_scale" in state
                if self.fp16_adam_stats:
                    if has_scales:
                        # torch cast the fp16 moments to the param dtype on load: exact, so cast back.
                        state["exp_avg"] = state["exp_avg"].to(torch.float16)
                        state["exp_avg_sq"] = state["exp_avg_sq"].to(torch.float16)
                        state["exp_avg_scale"] = state["exp_avg_scale"].detach().to("cpu", torch.float32)
                        state["exp_avg_sq_scale"] = state["exp_avg_sq_scale"].detach().to("cpu", torch.float32)
                    else:
                        self._quantize_state(p, state)
                else:
                    ea, eas = state["exp_avg"].float(), state["exp_avg_sq"].float()
                    if has_scales:
                        ea = ea * state.pop("exp_avg_scale").float()
                        eas = eas * state.pop("exp_avg_sq_scale").float()
                    state["exp_avg"], state["exp_avg_sq"] = ea.contiguous(), eas.contiguous()
        quantized_states.log_conversions(conversions - {None})


def _all_reduce_max(t: torch.Tensor, mesh) -> torch.Tensor:
    """Max over every rank of the mesh (the shards of one DTensor), on a device the backend accepts."""
    import torch.distributed as dist

    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        if dist.get_world_size(group) == 1:
            continue
        if dist.get_backend(group) == "nccl":
            dev = torch.device("cuda", torch.cuda.current_device())
            buf = t.to(dev)
            dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
            t = buf.cpu()
        else:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def _state_bytes(options: CPUAdamConfig, piece: ParameterPiece) -> int:
    """torch AdamW's layout (a float32 step and two moments) in the moments' precision: fp16 with an fp32 scale each
    under --fp16-adam-stats, else --adam-state-precision's (``quantized_states.moments_bytes``)."""
    if options.fp16_adam_stats:
        return 4 * piece.local_numel + 2 * 4 + 4
    return quantized_states.moments_bytes(options.adam_state_precision, piece.shape or (1,), piece.local or (1,)) + 4


def _note(options: CPUAdamConfig) -> str:
    return "cpu_adam " + ("fp16 stats" if options.fp16_adam_stats else options.adam_state_precision)


@register_optimizer("cpu_adam", dataclass=CPUAdamConfig, state=OptimizerState(_state_bytes, _note))
def build(cfg: CPUAdamConfig, params: list, lr: float) -> torch.optim.Optimizer:
    betas = check_adam_options(cfg, lr)
    if cfg.fp16_adam_stats and cfg.adam_state_precision != "fp32":
        raise UserError(
            f"--fp16-adam-stats and --adam-state-precision {cfg.adam_state_precision} both set the "
            "moments' precision; pass one of them"
        )
    return CPUAdam(
        params,
        lr=lr,
        betas=betas,
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        fp16_adam_stats=cfg.fp16_adam_stats,
        adam_state_precision=cfg.adam_state_precision,
    )
