"""Which keys a query sees, in the forms the back ends take.

A mask handed to :func:`~toolkit.models.common.attention.backends.attend` is one of:

- ``None``: causal, the queries being the last ``Tq`` of the ``Tk`` keys (training: the same positions);
- :data:`EVERY_KEY`: no mask (one new token after the cache sees every cached position);
- a bool tensor broadcast to [B, heads, Tq, Tk], True where the key is seen;
- a flex_attention ``BlockMask`` (CUDA: fully masked tiles skipped, no [T, T] tensor);
- a :class:`~toolkit.models.common.attention.across_ranks.ChunkedVisibility` (context parallelism: this rank's
  queries over the gathered keys).

:func:`attention_mask` is what a model builds once per forward (per distinct window): causal, inside each document
(``document_ids`` [B, T], ``--document-attention-mask``) and inside a layer's sliding window; the block-mask form
where :func:`flex_applies` says flex_attention runs (the mask's side of ``backends.choose_backend``), the dense form
otherwise.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class _EveryKey:
    """The mask of queries that see every key: no mask at all."""

    def __repr__(self) -> str:
        return "EVERY_KEY"


EVERY_KEY = _EveryKey()


# inductor's flex_attention kernel refuses heads narrower than this ("NYI: embedding dimension of the
# query, key, and value must be at least 16"); such (tiny) models attend with the dense mask instead.
FLEX_MIN_HEAD_DIM = 16


def flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def flex_applies(device: Any, head_dim: Optional[int], dropout: float = 0.0) -> bool:
    """Whether a model's masks take flex_attention's block form: on CUDA, heads at least ``FLEX_MIN_HEAD_DIM`` wide
    (None: not known, taken as wide enough), no attention dropout (flex_attention has none)."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    wide = head_dim is None or head_dim >= FLEX_MIN_HEAD_DIM
    return on_cuda and wide and dropout == 0.0 and flex_available()


def causal_mask(past: int, new: int, window: Optional[int] = None, device: Any = None) -> torch.Tensor:
    """bool [new, past + new]: the new positions past..past+new-1 see keys up to themselves (and within
    ``window``). Written with ``arange`` comparisons so that an exported graph keeps ``past`` symbolic."""
    query_pos = torch.arange(new, device=device) + past
    key_pos = torch.arange(past + new, device=device)
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask = mask & (query_pos[:, None] - key_pos[None, :] < window)
    return mask


def attention_mask(
    document_ids: Optional[torch.Tensor],
    seq_len: int,
    device: Any = None,
    window: Optional[int] = None,
    head_dim: Optional[int] = None,
    dropout: float = 0.0,
) -> Any:
    """The mask the layers of one forward attend with (built once per forward and window): None (plain causal), a
    flex ``BlockMask`` where flex_attention runs (CUDA, heads of ``head_dim``, no ``dropout``), otherwise a bool
    [B or 1, 1, T, T]."""
    if document_ids is None and window is None:
        return None
    device = document_ids.device if document_ids is not None else device
    if flex_applies(device, head_dim, dropout):
        return block_mask(document_ids, seq_len, window, device)
    mask = causal_mask(0, seq_len, window, device)[None]
    if document_ids is not None:
        mask = mask & (document_ids[:, :, None] == document_ids[:, None, :])
    return mask[:, None]


def block_mask(document_ids: Optional[torch.Tensor], seq_len: int, window: Optional[int], device: Any) -> Any:
    """flex_attention's BlockMask of the same mask: (k <= q), within the window, within the document."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch = 1 if document_ids is None else document_ids.size(0)

    def visible(b, h, q, k):
        seen = k <= q
        if window is not None:
            seen = seen & (q - k < window)
        return seen if document_ids is None else seen & (document_ids[b, q] == document_ids[b, k])

    return create_block_mask(visible, batch, None, seq_len, seq_len, device=device)


def dense_mask(block: Any, q: torch.Tensor) -> torch.Tensor:
    """The bool [B, 1, Tq, Tk] mask of a flex ``BlockMask`` (from its mask_mod: the same predicate)."""
    from torch.nn.attention.flex_attention import create_mask

    q_len, kv_len = block.seq_lengths
    return create_mask(block.mask_mod, q.size(0), 1, q_len, kv_len, device=q.device)


def is_block_mask(mask: Any) -> bool:
    """A flex ``BlockMask`` (duck-typed: flex_attention is imported only where a model uses it)."""
    return hasattr(mask, "mask_mod") and hasattr(mask, "kv_num_blocks")
