"""The output layer and the cross-entropy in one pass over chunks of rows, never holding all [N, V] logits.

``linear_cross_entropy(hidden, weight, target, ignore_index)`` is ``F.cross_entropy(F.linear(hidden,
weight).float(), target, ignore_index=ignore_index, reduction="sum")``, computed the way Liger-Kernel's and
torchtitan's chunked losses do it, in plain PyTorch: for each chunk of rows, the chunk's logits (in the weight's
dtype, as the unfused path), their fp32 softmax, the chunk's summed NLL, and, when a gradient is wanted, the
gradient of the loss w.r.t. those logits, ``softmax - onehot(target)`` (zero on ignored rows), which goes at once
into the gradients of the hidden states and of the weight. Backward then only scales the two stored gradients by
the incoming one (a dummy batch's 0, the fp16 loss scale).

Why: on CPU the head and the loss are ~40% of a small Llama's step, and most of the loss's time is passes over
the fp32 [N, V] logits (log-softmax, the NLL's dense gradient, log-softmax's backward). Here a chunk's logits
are read and written a few times while they are still in cache, the three matmuls are the same as unfused, and
the peak memory of the head is one chunk's logits instead of two or three [N, V] fp32 tensors.

What it does not do (the caller keeps the unfused path there, see ``toolkit.criterions.cross_entropy``):
label smoothing, a z-loss, a logit soft-cap, per-token (unreduced) losses, vocabulary-sharded weights (tensor
parallel: the softmax needs the whole row), adaptive softmax (no single [V, C] weight), fp16 matmuls (fp16's
dynamic loss scale is applied in backward, after this forward has cast the unscaled d logits to fp16, where a large
vocabulary's probabilities, ~1/V, fall among the subnormals; the logits path scales them first. bf16 has fp32's
range and fuses).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from toolkit import ops

# benchmarks/fused_loss.py (N 2048, V 8192, 1 thread): 512 and 1024 rows fastest, 512 at 30 MiB of temporaries
DEFAULT_CHUNK_ROWS = 512
# (a chunk holds rows x V fp32 logits: 16 MiB at V 8192, 256 MiB at V 128k; lower it for a large vocabulary)

# exp(z - max) is taken at z - max >= -87 (exp(-87) = 1.6e-38, just above fp32's smallest normal number). Why:
# torch's CPU exp is 15-40x slower where its result is subnormal or underflows (z - max below about -88: 150 ms
# against 8 for [512, 12448] on one thread), and a trained LM's logits spread that far over a vocabulary; the
# floor changes the sum of a row (>= 1) by at most V * 1.6e-38 and each probability by at most 1.6e-38: nothing
# fp32 can show.
EXP_FLOOR = -87.0


def _chunk_loss_and_grad(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int, want_grad: bool
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One chunk: summed NLL (fp32, 0-dim) and d loss / d logits in the matmul's dtype (or None)."""
    logits = F.linear(hidden, weight).float()  # [n, V]; a fresh tensor in fp32 too (the product's output)
    counted = target.ne(ignore_index)
    safe_target = torch.where(counted, target, torch.zeros_like(target)).unsqueeze(1)
    target_logit = logits.gather(1, safe_target).squeeze(1)
    row_max = logits.amax(dim=1, keepdim=True)
    logits.sub_(row_max).clamp_(min=EXP_FLOOR).exp_()  # logits now holds exp(z - max)
    sum_exp = logits.sum(dim=1, keepdim=True)
    log_z = sum_exp.log().add_(row_max).squeeze(1)
    loss = torch.where(counted, log_z - target_logit, torch.zeros_like(log_z)).sum()
    if not want_grad:
        return loss, None
    # softmax - onehot on counted rows, 0 on ignored ones: (exp / sum) * counted, then -1 at the target
    scale = counted.unsqueeze(1).to(logits.dtype) / sum_exp
    grad = logits.mul_(scale)
    grad.scatter_add_(1, safe_target, -counted.unsqueeze(1).to(grad.dtype))
    return loss, grad.to(weight.dtype)


def _add_weight_grad(
    total: Optional[torch.Tensor], grad_logits: torch.Tensor, h: torch.Tensor, transposed: bool
) -> torch.Tensor:
    """``total`` plus this chunk's ``grad_logits^T h`` in fp32 (``total`` None: the first chunk's alone).

    ``transposed`` (fp32 products through oneDNN, ``toolkit.ops``): the sum is kept as [C, V],
    contiguous, the orientation oneDNN computes fastest, and summed without a strided pass (the caller turns it
    back into a [V, C] view); else as [V, C], by ``addmm_``."""
    if transposed:
        part = F.linear(h.t(), grad_logits.t())  # [C, V]
        return part if total is None else total.add_(part)
    if total is None:
        return torch.mm(grad_logits.t().float(), h.float())
    return total.addmm_(grad_logits.t().float(), h.float())


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and (when ``want_grad``) both gradients; backward scales them."""

    @staticmethod
    def forward(
        ctx, hidden, weight, target, ignore_index: int, chunk_rows: int, want_grad: bool, compute_dtype: torch.dtype
    ):
        n = hidden.size(0)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_grad and ctx.needs_input_grad[0] else None
        grad_weight = None  # the weight's gradient, summed over chunks in fp32 (as one matmul of all rows would)
        with torch.autocast(hidden.device.type, enabled=False):  # the casts autocast would do, done once here
            w = weight.to(compute_dtype)
            transposed = ops.uses_onednn(hidden, w)  # the weight's gradient summed as [C, V]
            for start in range(0, n, chunk_rows):
                rows = slice(start, min(start + chunk_rows, n))
                h = hidden[rows].to(compute_dtype)
                chunk_loss, grad_logits = _chunk_loss_and_grad(h, w, target[rows], ignore_index, want_grad)
                loss += chunk_loss
                if grad_hidden is not None:
                    grad_hidden[rows] = F.linear(grad_logits, w.t())
                if want_grad and ctx.needs_input_grad[1]:
                    grad_weight = _add_weight_grad(grad_weight, grad_logits, h, transposed)
                del grad_logits  # before the next chunk's logits: one chunk's [rows, V] alive at a time
        if want_grad and ctx.needs_input_grad[1]:
            if grad_weight is None:  # no rows
                grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            elif transposed:
                grad_weight = grad_weight.t()
        ctx.save_for_backward(grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_loss.to(torch.float32)
        return (
            None if grad_hidden is None else _scaled(grad_hidden, scale),
            None if grad_weight is None else _scaled(grad_weight, scale),
            None,
            None,
            None,
            None,
            None,
        )


def _scaled(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """grad * scale written contiguous: the weight's gradient summed as [C, V] (``_add_weight_grad``) is a
    transposed view, which autograd would otherwise copy into the parameter's layout in a second pass (the
    multiply's strided read costs 2.6 ms for a [12448 x 512] head, the copy 4-7 ms more)."""
    out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
    return torch.mul(grad, scale.to(grad.dtype), out=out)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """Summed NLL in nats (fp32, 0-dim) of ``target`` [...] under the logits ``hidden [..., C] @ weight[V, C].T``,
    rows whose target is ``ignore_index`` not counted; the [N, V] logits are never all in memory at once."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows}")
    hidden = hidden.reshape(-1, hidden.size(-1))
    target = target.reshape(-1)
    if hidden.size(0) != target.size(0):
        raise ValueError(f"{hidden.size(0)} hidden rows for {target.size(0)} targets")
    # decided here: inside Function.forward grad mode is off, so it could not tell training from evaluation
    want_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(
        hidden, weight, target, ignore_index, chunk_rows, want_grad, matmul_dtype(hidden, weight)
    )


def matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: under --fp16/--bf16 autocast, autocast's; else the weight's."""
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


class LossTarget(NamedTuple):
    """What the criterion hands a model's ``forward(..., loss_target=)`` to get the summed NLL instead of logits."""

    target: torch.Tensor  # [B, T] next tokens, aligned with the model's input
    ignore_index: int  # the padding index: those positions count nothing
    chunk_rows: int = DEFAULT_CHUNK_ROWS
