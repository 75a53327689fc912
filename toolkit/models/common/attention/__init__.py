"""One attention for every family: variants over one core call, its back ends chosen in one place.

============================  ==============================================================================
``variants``                  how a layer projects: :class:`Attention` (multi-head / GQA / MQA, QK-norm per head
                              or over the projection, soft-cap, sliding window, scale, sinks, biases),
                              :class:`GatedAttention` (Qwen3-Next), :class:`FusedQKVAttention` (fairseq),
                              :class:`LatentAttention` (DeepSeek-V2/V3's multi-head latent attention)
``layer``                     :class:`AttentionLayer`, the base: this forward's keys, the KV cache's, the other
                              context-parallel ranks', and the cache as tensors in and out for ONNX
``backends``                  :func:`attend`, the core call, and :func:`choose_backend`, which picks SDPA,
                              flex_attention, the explicit softmax(q k^T) v or the context-parallel tiles
``masks``                     which keys a query sees: causal, documents, windows, as the back ends take them
``across_ranks``              context parallelism's visibility and its tiled CPU kernel
``cache``                     :class:`KVCache`: a layer's entries of the positions decoded so far
``gated_deltanet``            :class:`GatedDeltaNet`, the linear attention of Qwen3-Next / Qwen3.5 (a recurrent
                              state per head, its :class:`RecurrentState` decoding's instead of a K/V cache)
============================  ==============================================================================

Only this package calls ``scaled_dot_product_attention`` or ``flex_attention``.
"""

from toolkit.models.common.attention.across_ranks import ChunkedVisibility, visible_keys
from toolkit.models.common.attention.backends import attend, choose_backend, explicit_attention
from toolkit.models.common.attention.cache import KVCache
from toolkit.models.common.attention.gated_deltanet import GatedDeltaNet, RecurrentState
from toolkit.models.common.attention.layer import AttentionLayer, KeyExchange, attend_across_ranks
from toolkit.models.common.attention.masks import (
    EVERY_KEY,
    FLEX_MIN_HEAD_DIM,
    attention_mask,
    causal_mask,
    flex_applies,
)
from toolkit.models.common.attention.variants import (
    Attention,
    FusedQKVAttention,
    GatedAttention,
    LatentAttention,
    latent_attention_scale,
)

__all__ = [
    "Attention",
    "AttentionLayer",
    "ChunkedVisibility",
    "EVERY_KEY",
    "FLEX_MIN_HEAD_DIM",
    "FusedQKVAttention",
    "GatedAttention",
    "GatedDeltaNet",
    "KVCache",
    "KeyExchange",
    "LatentAttention",
    "RecurrentState",
    "attend",
    "attend_across_ranks",
    "attention_mask",
    "causal_mask",
    "choose_backend",
    "explicit_attention",
    "flex_applies",
    "latent_attention_scale",
    "visible_keys",
]
