"""``--bf16-host-grads``: keep FSDP2's offloaded gradients in bf16 in host memory (2 bytes, not 4, per parameter).

Why a hook: FSDP2 stores each reduce-scattered gradient in the sharded parameter's own dtype
(fp32 master weights): ``foreach_reduce`` casts the reduce output to the param group's
``_orig_dtype`` before the device-to-host copy (torch/distributed/fsdp/_fully_shard/
_fsdp_collectives.py), and ``MixedPrecisionPolicy.reduce_dtype`` only sets the collective's
dtype. Changing that needs torch internals. With public API instead: ``grad_dtype = None``
lets a parameter hold a gradient of another dtype, and a post-accumulate-grad hook (FSDP2
runs them right after it assigns each sharded gradient) re-stores it in bf16. Each FSDP
group's fp32 gradients then live only until its hook runs (one transformer block at a time).

Costs: a parameter with such a hook gets its gradient copied to the host synchronously
(FSDP2 skips the non-blocking copy so the hook never reads memory in flight), and with
``--update-freq`` > 1 FSDP2 adds the next micro-batch's gradient into the bf16 one (bf16
accumulation). cpu_adam casts the gradient to fp32 a slice at a time inside its update.
"""

from __future__ import annotations

import torch

from toolkit.core.dtensor import dtensor_like, is_dtensor


def _store_in_bf16(param: torch.Tensor) -> None:
    grad = param.grad
    if grad is None or grad.dtype == torch.bfloat16:
        return  # already bf16 (a later micro-batch was added into it)
    param.grad = None  # free the fp32 gradient before allocating its bf16 copy's successor
    if is_dtensor(grad):
        local = grad.to_local().to(torch.bfloat16)
        del grad
        param.grad = dtensor_like(local, param)  # stays in host memory under --cpu-offload
    else:
        param.grad = grad.to(torch.bfloat16)


def keep_grads_in_bf16(model: torch.nn.Module) -> int:
    """Make every trainable parameter of ``model`` keep its gradient in bf16; the number of parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad_dtype = None  # allow a gradient dtype other than the parameter's
        p.register_post_accumulate_grad_hook(_store_in_bf16)
    return len(params)
