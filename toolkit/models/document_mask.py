"""Document-masked packing: attention (and optionally positions) kept inside each document of a block.

With ``--sample-break-mode none`` a block holds the end of one document, whole documents and the
start of another, back to back (each line ends with ``</s>``). ``--document-attention-mask``
stops attention at the document boundaries: position t attends to s only when s <= t and both
are in the same document (block-diagonal causal), so each document is scored as if it were
alone; ``--reset-position-ids`` restarts the positions at 0 in each document, so it also sees
the positions it would have alone.

A document starts where the *input* token is ``</s>``: the input is the target shifted right,
so the position that reads the previous line's ``</s>`` predicts the first token of the next
line (as a line on its own starts from ``</s>``). The data side (the collater) sends
``document_ids`` [B, T] and, for reset positions, ``positions`` [B, T]; both model families
take them as keyword arguments of ``forward`` and pass the mask to every block.

The mask is ``flex_attention``'s block mask on CUDA (no [T, T] tensor, fully masked tiles
skipped) when torch has it and attention has no dropout, otherwise a boolean SDPA mask
[B, 1, T, T].
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F


def _flex():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    return create_block_mask, flex_attention


def make_attention_mask(
    document_ids: Optional[torch.Tensor], dropout: float = 0.0, head_dim: Optional[int] = None
) -> Any:
    """What the blocks attend with: None (plain causal), a flex BlockMask, or a bool [B, 1, T, T] mask.

    ``head_dim``: the model's head width; heads narrower than flex_attention allows get the dense mask
    here, once per forward, rather than from ``attend`` in every layer."""
    if document_ids is None:
        return None
    flex_heads = head_dim is None or head_dim >= FLEX_MIN_HEAD_DIM
    if _flex() is not None and document_ids.is_cuda and dropout == 0.0 and flex_heads:
        return document_block_mask(document_ids)
    T = document_ids.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return (causal & (document_ids[:, :, None] == document_ids[:, None, :]))[:, None]


def document_block_mask(document_ids: torch.Tensor):
    """flex_attention's BlockMask of the same mask: (k <= q) and the same document."""
    create_block_mask, _ = _flex()
    B, T = document_ids.shape

    def same_document_causal(b, h, q, k):
        return (k <= q) & (document_ids[b, q] == document_ids[b, k])

    return create_block_mask(same_document_causal, B, None, T, T, device=document_ids.device)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Any = None,
    dropout: float = 0.0,
    enable_gqa: bool = False,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Causal attention of q, k, v [B, heads, T, D] under ``make_attention_mask``'s mask (``scale``: the
    logits' multiplier, default 1/sqrt(D))."""
    if attn_mask is None:
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=enable_gqa, scale=scale
        )
    if isinstance(attn_mask, torch.Tensor):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout, enable_gqa=enable_gqa, scale=scale
        )
    if q.size(-1) < FLEX_MIN_HEAD_DIM:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=_dense_mask(attn_mask, q), dropout_p=dropout, enable_gqa=enable_gqa, scale=scale
        )
    return _compiled_flex()(q, k, v, block_mask=attn_mask, enable_gqa=enable_gqa, scale=scale)


# inductor's flex_attention kernel refuses heads narrower than this ("NYI: embedding dimension of the
# query, key, and value must be at least 16"); such (tiny) models attend with the dense mask instead.
FLEX_MIN_HEAD_DIM = 16


def _dense_mask(block_mask: Any, q: torch.Tensor) -> torch.Tensor:
    """The bool [B, 1, T, T] mask of a flex BlockMask (from its mask_mod: the same predicate)."""
    from torch.nn.attention.flex_attention import create_mask

    B, T = q.size(0), q.size(2)
    return create_mask(block_mask.mask_mod, B, 1, T, T, device=q.device)


_COMPILED: list = []


def _compiled_flex():
    """flex_attention compiled once (eager flex materializes the whole score matrix)."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(_flex()[1], dynamic=False))
    return _COMPILED[0]


def packing_inputs(net_input: dict) -> dict:
    """The keyword arguments a model's forward takes from a batch (none for unmasked batches; ``context_parallel``:
    the sequence shard of ``--context-parallel-size``, see ``toolkit.distributed.context_parallel``)."""
    return {key: net_input[key] for key in ("document_ids", "positions", "context_parallel") if key in net_input}
