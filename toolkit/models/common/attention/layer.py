"""``AttentionLayer``: what every attention variant shares, where its keys and values come from.

A variant (``variants.py``) says how a layer turns its input into queries and into what each position leaves for
later ones, and how the attention's output leaves the layer:

- ``project(x, cos, sin) -> (q, entries, carry)``: q [B, H, T, D] (rotated); ``entries``, a tuple of [B, *, T, *]
  tensors, what a position leaves behind: the KV cache stores them, context parallelism exchanges them (k and v
  of G heads here; a latent attention's compressed kv and its shared rotary key); ``carry``: what ``output`` needs
  besides the attention (Qwen3-Next's gate), or None;
- ``keys_values(entries) -> (k [B, G, S, D], v [B, G, S, Dv])``: the entries of S positions expanded into keys and
  values (as they are, for multi-head attention; through the up-projections, for latent attention);
- ``output(y [B, H, T, Dv], carry) -> [B, T, C]``;
- optionally ``attend_cached(q, entries, mask)``: decoding's attention over the cached entries (by default expanded
  through ``keys_values``; latent attention attends over its latents as they are, the up-projections absorbed);
- ``kv_width()``: the features of one position's entries (what context parallelism exchanges per token: the planner);

and sets the logits' options (``window``, ``scale``, ``softcap``, ``sinks``, ``dropout``). This class then runs the
three ways keys arrive, each through the one core call, ``backends.attend``:

- this forward's own positions, under the model's mask (``masks.attention_mask``, built once per forward);
- the KV cache (``forward`` with ``kv_cache``): the new positions P..P+T-1 see every cached
  one (within the window) and the new ones up to themselves; a local layer's cache keeps the last window - 1;
- the other context-parallel ranks (:func:`attend_across_ranks`, with ``context_parallel``, which runs it outside
  compiled graphs): the entries gathered over the cp group, this rank's queries over the whole sequence;

and the cache as plain tensors in and out for ONNX (:meth:`AttentionLayer.forward_with_past`, the explicit form).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Tuple

import torch
import torch.nn as nn

from toolkit.models.common.attention.across_ranks import ChunkedVisibility
from toolkit.models.common.attention.backends import attend
from toolkit.models.common.attention.cache import KVCache
from toolkit.models.common.attention.masks import EVERY_KEY, causal_mask
from toolkit.models.common.attention.qk_clip import head_max_logits

Entries = Tuple[torch.Tensor, ...]


class KeyExchange(Protocol):
    """What context parallelism hands a layer (``toolkit.distributed.context_parallel.ContextShard``): the gathering
    of every rank's entries, which gathered key each of this rank's queries sees, and ``attend``, which runs
    :func:`attend_across_ranks` with itself eagerly under ``--compile`` (``torch.compiler.disable``, applied where
    only context-parallel runs import it: importing the compiler costs every other run its start-up)."""

    def gather(self, entries: Entries) -> Entries: ...

    def visibility(self, window: Optional[int]) -> ChunkedVisibility: ...

    def attend(self, layer: AttentionLayer, q: torch.Tensor, entries: Entries) -> torch.Tensor: ...


class AttentionLayer(nn.Module):
    """The base of the attention variants (see the module docstring for what a variant provides)."""

    def __init__(
        self,
        window: Optional[int] = None,
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.window, self.scale, self.softcap, self.dropout = window, scale, softcap, dropout
        self.sinks: Optional[nn.Parameter] = None  # a variant with sinks sets a parameter [H]
        self.records_max_logit = False  # QK-clip (``qk_clip.py``): keep each head's largest logit in training
        self.max_logit: Optional[torch.Tensor] = None  # [H], the largest since the last clip

    def record_max_logit(self) -> None:
        """Keep each query head's largest logit over the training forwards until ``qk_clip.clip_heads`` reads
        them (Kimi K2's QK-clip)."""
        self.records_max_logit = True

    def project(self, x: torch.Tensor, cos: Any, sin: Any) -> Tuple[torch.Tensor, Entries, Any]:
        raise NotImplementedError

    def keys_values(self, entries: Entries) -> Tuple[torch.Tensor, torch.Tensor]:
        k, v = entries
        return k, v

    def output(self, y: torch.Tensor, carry: Any) -> torch.Tensor:
        raise NotImplementedError

    def kv_width(self) -> int:
        raise NotImplementedError

    def expanded_kv_width(self) -> int:
        """Features of one position's keys and values as attention reads them: ``kv_width()`` where the entries are
        the keys and values (a latent attention's are fewer: toolkit-plan compares the two)."""
        return self.kv_width()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, export: bool = False):
        """The core call with this layer's options."""
        dropout = self.dropout if self.training else 0.0
        return attend(
            q, k, v, mask, scale=self.scale, softcap=self.softcap, sinks=self.sinks, dropout=dropout, export=export
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: Any = None,
        sin: Any = None,
        kv_cache: Optional[KVCache] = None,
        attn_mask: Any = None,
        context_parallel: Optional[KeyExchange] = None,
    ) -> torch.Tensor:
        """x [B, T, C] -> [B, T, C]. ``attn_mask``: ``masks.attention_mask``'s (None: causal; a window without one is
        masked here); ``kv_cache``: incremental decoding; ``context_parallel``: the keys of the whole sequence."""
        q, entries, carry = self.project(x, cos, sin)
        if context_parallel is not None:
            y = context_parallel.attend(self, q, entries)
        elif kv_cache is not None:
            y = self._cached_step(q, entries, kv_cache)
        else:
            k, v = self.keys_values(entries)
            if attn_mask is None and self.window is not None:
                attn_mask = causal_mask(0, q.size(2), self.window, q.device)
            if self.records_max_logit and self.training:
                self._record_max_logit(q, k, attn_mask)
            y = self.attend(q, k, v, attn_mask)
        return self.output(y, carry)

    def _record_max_logit(self, q: torch.Tensor, k: torch.Tensor, mask: Any) -> None:
        scale = q.size(-1) ** -0.5 if self.scale is None else self.scale
        heads = head_max_logits(q, k, mask, scale, self.window)
        self.max_logit = heads if self.max_logit is None else torch.maximum(self.max_logit, heads)

    def attend_cached(self, q: torch.Tensor, entries: Entries, mask: Any) -> torch.Tensor:
        """The queries of the new positions over the cached ``entries`` (theirs included): the keys and values
        expanded from them (a variant may attend over its entries as they are: latent attention's absorbed form)."""
        k, v = self.keys_values(entries)
        return self.attend(q, k, v, mask)

    def _cached_step(self, q: torch.Tensor, entries: Entries, cache: KVCache) -> torch.Tensor:
        P, T = cache.length, q.size(2)  # P: the cached positions (the last window - 1 in a local layer)
        needs_mask = T > 1 or (self.window is not None and P + T > self.window)
        mask = causal_mask(P, T, self.window, q.device) if needs_mask else EVERY_KEY
        y = self.attend_cached(q, cache.append(*entries), mask)
        if self.window is not None:
            cache.keep_last(self.window - 1)  # the next position reads these and itself
        return y

    def forward_with_past(self, x: torch.Tensor, cos: Any, sin: Any, past: Entries) -> Tuple[torch.Tensor, Entries]:
        """The layer after P cached positions with the cache as plain tensors (``past``: the entries [B, *, P, *]):
        (output [B, T, C], the grown entries [B, *, P + T, *]), in the explicit form (what ONNX export traces)."""
        q, entries, carry = self.project(x, cos, sin)
        present = tuple(torch.cat([old, new], dim=2) for old, new in zip(past, entries))
        k, v = self.keys_values(present)
        mask = causal_mask(past[0].size(2), x.size(1), self.window, x.device)  # [T, P + T]
        return self.output(self.attend(q, k, v, mask, export=True), carry), present


def attend_across_ranks(layer: AttentionLayer, q: torch.Tensor, entries: Entries, exchange: KeyExchange):
    """This rank's queries q [B, H, T/C, D] over the whole sequence: the entries of every cp rank gathered (one
    collective), expanded into keys and values, under the layout's visibility of the layer's window.

    Eager under ``--compile`` (``KeyExchange.attend``): a compiled block is a graph before and one after this call
    (``toolkit.distributed.compile``). Traced, the collective would break the graph anyway, and the tiles (which
    exist, which are causal, which carry a mask) are Python decisions on each batch's document boundaries that a
    graph would guard on, recompiling batch after batch."""
    k, v = layer.keys_values(exchange.gather(entries))
    return layer.attend(q, k, v, exchange.visibility(layer.window))
