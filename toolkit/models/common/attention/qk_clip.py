"""Kimi K2's QK-clip (MuonClip, ``--qk-clip-threshold`` tau): after each update, a head whose largest pre-softmax
logit of the update went past tau has its query and key projections scaled so that the same inputs would give it
exactly tau; every other head's logits stay as they were.

Recording: a layer with ``record_max_logit()`` keeps, over the training forwards of one update (every micro-batch),
each query head's largest logit ``scale * q . k`` over the keys its mask lets it see (:func:`head_max_logits`:
the logits of the plain forward computed once more without gradient, whatever back end attends; the soft-cap and
sinks, applied after, do not enter). Between updates :func:`clip_heads` takes gamma_h = min(1, tau / max_h), the
maxima first reduced over the data-parallel ranks (all-reduce MAX: every rank then rescales its shards the same),
and rescales the layer's weights (:meth:`Attention.clip_heads`, :meth:`LatentAttention.clip_heads`):

- multi-head attention: head h's query rows (and bias) times sqrt(gamma_h), its key rows times sqrt(gamma_h), the
  report's rule. Under grouped-query attention a key head serves H/G query heads: it takes sqrt(g) with g the
  smallest gamma of its group, and each query head gamma_h / sqrt(g), so every head's logits are scaled by its own
  gamma (1 for a head that stayed below tau, whose query rows still move to balance the shared key);
- latent attention: head h's unrotated query rows and its key rows of ``kv_b_proj`` times sqrt(gamma_h), its
  rotary query rows times gamma_h; the rotary key, shared by the heads, untouched.

The weights are rescaled where they live: a DTensor shard (FSDP2/HSDP) is multiplied by the same scales placed as
it is. Not for QK-norm (an RMSNorm after the projections undoes their scale) nor tensor or context parallelism
(``config/composition.py`` refuses them).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from toolkit.core.errors import UserError
from toolkit.models.common.attention.masks import EVERY_KEY, causal_mask, dense_mask, is_block_mask


LOGITS_PER_CHUNK = 1 << 24  # fp32 logits computed at once (64 MiB): the queries go through in slices this size


@torch.no_grad()
def head_max_logits(q: torch.Tensor, k: torch.Tensor, mask: Any, scale: float, window: Optional[int]) -> torch.Tensor:
    """The largest logit ``scale * q . k`` of each query head [H] over the keys ``mask`` lets a query see (the
    forms of ``masks``; None: causal in ``window``). q [B, H, T, D], k [B, G, S, D]; the queries in slices, so
    that no [B, H, T, S] tensor of logits is ever whole."""
    B, H, T, _ = q.shape
    G, S = k.size(1), k.size(2)
    if mask is None:
        mask = causal_mask(S - T, T, window, q.device)
    elif is_block_mask(mask):
        mask = dense_mask(mask, q)
    queries = q.float().unflatten(1, (G, H // G))
    keys = k.float()
    step = max(1, LOGITS_PER_CHUNK // (B * H * S))
    best = torch.full((H,), float("-inf"), device=q.device)
    for start in range(0, T, step):
        logits = torch.einsum("bgrtd,bgsd->bgrts", queries[:, :, :, start : start + step], keys).flatten(1, 2)
        if mask is not EVERY_KEY:
            logits = logits.masked_fill(~mask[..., start : start + step, :], float("-inf"))
        best = torch.maximum(best, (logits * scale).amax(dim=(0, 2, 3)))
    return best


def qk_clip_hook(model: torch.nn.Module, threshold: float) -> Callable[[], None]:
    """The trainer's post-step hook of ``--qk-clip-threshold``: ``model``'s attention layers set to record their
    heads' largest logits, clipped after each update; a one-line refusal for a layer that cannot be clipped."""
    layers = [m for m in model.modules() if hasattr(m, "record_max_logit")]  # the AttentionLayers
    for layer in layers:
        if not hasattr(layer, "clip_heads"):
            raise UserError(
                f"--qk-clip-threshold: {type(layer).__name__} has no QK-clip (multi-head, grouped-query and latent "
                "attention have); drop the flag"
            )
        if getattr(layer, "q_norm", None) is not None:
            raise UserError(
                "--qk-clip-threshold with --qk-norm: the RMSNorm after the q/k projections undoes their scaling, so "
                "nothing would be clipped (QK-norm bounds the logits itself); drop one of them"
            )
        layer.record_max_logit()
    return lambda: clip_heads(layers, threshold)


@torch.no_grad()
def clip_heads(layers: List[Any], threshold: float) -> int:
    """After an update: each layer's heads past ``threshold`` rescaled (module docstring), the records cleared.
    Returns how many heads were clipped."""
    recorded = [layer for layer in layers if layer.max_logit is not None]
    if not recorded:
        return 0
    maxima = torch.cat([layer.max_logit for layer in recorded])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    clipped = 0
    for layer, layer_max in zip(recorded, maxima.split([len(layer.max_logit) for layer in recorded])):
        layer.max_logit = None
        gamma = (threshold / layer_max).clamp(max=1.0)
        if bool((gamma < 1).any()):
            layer.clip_heads(gamma)
            clipped += int((gamma < 1).sum())
    return clipped


def scale_rows(weight: torch.Tensor, rows: torch.Tensor) -> None:
    """``weight`` [R, ...] (a parameter, a DTensor shard or whole) times ``rows`` [R] row by row, in place."""
    rows = rows.to(dtype=weight.dtype, device=weight.device).view(-1, *([1] * (weight.dim() - 1)))
    if hasattr(weight, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        rows = distribute_tensor(rows.expand(weight.shape).contiguous(), weight.device_mesh, weight.placements)
    weight.mul_(rows)
