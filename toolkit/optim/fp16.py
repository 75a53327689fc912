"""Mixed precision helpers for the trainer: ``--fp16``, ``--memory-efficient-fp16``, ``--bf16``.

How each flag is realized

* ``--fp16`` / ``--bf16``: the weights (and optimizer state) stay fp32; compute runs in
  fp16/bf16. Under ``--ddp-backend fully_sharded`` FSDP2's ``MixedPrecisionPolicy``
  (param_dtype fp16/bf16, reduce_dtype fp32) casts the gathered weights, otherwise the
  trainer runs forward under ``torch.autocast``. fp16 adds dynamic loss scaling
  (:mod:`toolkit.optim.loss_scaler`); bf16 has the fp32 exponent range and needs none.
* ``--memory-efficient-fp16`` (fairseq's ``MemoryEfficientFP16Optimizer`` semantics):
  there is no fp32 copy of the weights. Without sharding the model itself is cast to
  fp16 (:func:`half_model_`), so parameters and gradients are fp16, while the optimizer
  state stays fp32: :class:`MemoryEfficientFP16` steps the wrapped optimizer a chunk of
  parameters at a time on fp32 stand-ins (parameters, and gradients with the
  unscale/normalize/clip factor folded in, in fp32 so that small gradients do not
  underflow), and copies the result back into the fp16 parameters in place. Transient fp32
  memory: one chunk (``chunk_numel`` elements, default 4M), not the model. The cast to fp16
  happens before a DDP wrapper is built (``parallelize``; the trainer does it for one process).
  The loss scale, overflow skip and gradient norm work as with ``--fp16``; the norm is
  computed in fp32 (:func:`grad_norm_fp32`): the norm of scaled fp16 gradients easily exceeds the fp16 range.
  Under ``--ddp-backend fully_sharded`` it maps to the same ``MixedPrecisionPolicy`` as
  ``--fp16``: the fp32 master weights exist only as this rank's 1/N shard (in host memory
  with ``--cpu-offload``), the device holds the fp16 unsharded weights only while a block
  runs; that already is the memory saving fairseq's flag is for, with better numerics.

Checkpoints of a memory-efficient run hold fp16 weights (as fairseq's) and fp32 optimizer
state; torch's ``Optimizer.load_state_dict`` casts floating state to the parameter dtype,
so :meth:`MemoryEfficientFP16.keep_fp32_state_on_load` restores the fp32 values after a load.
"""

from __future__ import annotations

import logging
from typing import Dict, Iterable, List, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

CPU_SLOW_WARNING = "--{flag} on CPU: {dtype} compute works but is much slower than fp32 on most CPUs ({this})"


def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` matrices natively (bf16: AVX512-BF16 or AMX; fp16: AMX-FP16)."""
    try:
        import torch.cpu as tcpu

        if dtype == torch.bfloat16:
            return bool(tcpu._is_avx512_bf16_supported() or tcpu._is_amx_tile_supported())
        if dtype == torch.float16:
            return bool(tcpu._is_amx_fp16_supported())
    except Exception:  # private helpers: absent in some torch builds
        pass
    return False


def warn_if_slow_on_cpu(device: torch.device, compute_dtype: torch.dtype, flag: str) -> bool:
    """One WARNING line when fp16/bf16 compute runs on a CPU (the trainer calls it once, on rank 0)."""
    if device.type != "cpu" or compute_dtype == torch.float32:
        return False
    name = str(compute_dtype).replace("torch.", "")
    this = (
        f"this CPU has native {name} matrix multiplies, other ops still convert"
        if cpu_has_native(compute_dtype)
        else f"this one included: no native {name} matrix multiply; use it to test a configuration, "
        f"train in fp32 on CPU"
    )
    logger.warning(CPU_SLOW_WARNING.format(flag=flag, dtype=name, this=this))
    return True


def half_model_(model: torch.nn.Module) -> torch.nn.Module:
    """Cast floating parameters and buffers to fp16 in place (``--memory-efficient-fp16``).

    Must run before a DDP wrapper is built (DDP's buckets take the parameters' dtype).
    """
    return model.half()


@torch.no_grad()
def grad_norm_fp32(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of the gradients, computed and returned in fp32 whatever their dtype (a 0-dim tensor).

    inf/NaN in any gradient gives a non-finite norm (the overflow signal).
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    norms = [torch.linalg.vector_norm(g, 2, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), 2)


class MemoryEfficientFP16:
    """Step an optimizer over fp16 parameters with fp32 math and fp32 state, a chunk at a time.

    The wrapped optimizer is the trainer's optimizer itself (so learning-rate schedules,
    ``param_groups`` and ``torch.distributed.checkpoint`` see it unchanged); this object
    only drives its ``step``: torch's optimizers, and ``cpu_adam`` (whose DeepSpeed-side maps
    :meth:`_substitute` updates as well). Plain tensors only (not FSDP2's DTensors).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, chunk_numel: int = 1 << 22):
        self.optimizer = optimizer
        self.chunk_numel = max(1, int(chunk_numel))
        self.keep_fp32_state_on_load(optimizer)

    # -- step ------------------------------------------------------------------
    def _params(self) -> List[torch.Tensor]:
        seen, out = set(), []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _chunks(self, params: List[torch.Tensor]) -> List[List[torch.Tensor]]:
        chunks: List[List[torch.Tensor]] = []
        size = 0
        for p in params:
            if not chunks or size + p.numel() > self.chunk_numel:
                chunks.append([])
                size = 0
            chunks[-1].append(p)
            size += p.numel()
        return chunks

    def _state_to_fp32(self, p: torch.Tensor) -> None:
        """State made while the parameter was fp16 (e.g. by a state_dict helper's dummy step) -> fp32."""
        state = self.optimizer.state.get(p)
        if not state:
            return
        for k, v in list(state.items()):
            if k != "step" and torch.is_tensor(v) and v.is_floating_point() and v.dtype != torch.float32:
                state[k] = v.float()

    def _substitute(self, pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put ``new`` where the optimizer holds ``old`` (param_groups, state; cpu_adam's own maps too)."""
        opt = self.optimizer
        by_id = {id(old): new for old, new in pairs}
        for group in opt.param_groups:
            group["params"] = [by_id.get(id(x), x) for x in group["params"]]
        for old, new in pairs:
            if old in opt.state:
                opt.state[new] = opt.state.pop(old)
        local_views = getattr(opt, "_locals", None)  # toolkit.optim.cpu_adam.CPUAdam: DeepSpeed's side
        ds = getattr(opt, "_ds", None)
        if local_views is not None and ds is not None:
            for old, new in pairs:
                local_views.pop(old, None)
                local_views[new] = new
                ds.state.pop(old, None)
            for group in ds.param_groups:
                group["params"] = [by_id.get(id(x), x) for x in group["params"]]

    @torch.no_grad()
    def step(self, grad_factor: float = 1.0) -> None:
        """``optimizer.step()`` on ``fp32(grad) * grad_factor``; parameters rounded back in place.

        The optimizer steps fp32 stand-ins of one chunk of parameters at a time (swapped into its
        param_groups and state); the parameters themselves are only written with ``copy_``, so
        their storage and autograd identity (DDP's gradient hooks) stay as they are. (Changing a
        parameter's dtype through ``p.data = ...`` would reset its gradient accumulator and
        silently disconnect DDP's all-reduce hooks.)
        """
        params = [p for p in self._params() if p.grad is not None]
        for p in params:
            if not isinstance(p, torch.Tensor) or hasattr(p, "to_local"):
                raise TypeError(
                    "MemoryEfficientFP16: plain (non-DTensor) parameters only; under FSDP2 "
                    "--memory-efficient-fp16 uses the mixed-precision policy instead"
                )
        grads: Dict[int, torch.Tensor] = {id(p): p.grad for p in params}
        for p in params:
            p.grad = None  # hidden: the optimizer skips parameters without a gradient
        try:
            for chunk in self._chunks(params):
                pairs = []
                for p in chunk:
                    g = grads.pop(id(p))
                    g32 = g.float() if g.dtype != torch.float32 else g.clone()
                    if grad_factor != 1.0:
                        g32.mul_(grad_factor)
                    shadow = p.detach().float() if p.dtype != torch.float32 else p.detach().clone()
                    shadow.requires_grad_(p.requires_grad)
                    shadow.grad = g32
                    self._state_to_fp32(p)
                    pairs.append((p, shadow))
                self._substitute(pairs)
                try:
                    self.optimizer.step()
                finally:
                    self._substitute([(new, old) for old, new in pairs])
                for p, shadow in pairs:
                    p.copy_(shadow)  # rounds to the parameter's dtype
        finally:
            for p in params:  # only after an exception midway: put back what was not stepped
                if id(p) in grads:
                    p.grad = grads.pop(id(p))

    # -- state_dict --------------------------------------------------------------
    @staticmethod
    def keep_fp32_state_on_load(optimizer: torch.optim.Optimizer) -> None:
        """After ``load_state_dict``, keep the loaded fp32 state instead of torch's cast to fp16."""
        if getattr(optimizer, "_toolkit_fp32_state_hooks", False):
            return
        optimizer._toolkit_fp32_state_hooks = True
        pending: List[Optional[dict]] = [None]

        def pre_hook(opt, state_dict):
            pending[0] = state_dict
            return None

        def post_hook(opt):
            state_dict, pending[0] = pending[0], None
            if state_dict is None:
                return
            saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
            params = [p for g in opt.param_groups for p in g["params"]]
            id_map = dict(zip(saved_ids, params))
            for key, saved in state_dict["state"].items():
                p = id_map.get(key)
                if p is None or p not in opt.state or p.is_floating_point() is False:
                    continue
                for k, v in saved.items():
                    if (
                        k != "step"
                        and torch.is_tensor(v)
                        and v.is_floating_point()
                        and v.dtype == torch.float32
                        and p.dtype != torch.float32
                    ):
                        opt.state[p][k] = v.detach().to(device=p.device, copy=True)

        optimizer.register_load_state_dict_pre_hook(pre_hook)
        optimizer.register_load_state_dict_post_hook(post_hook)
