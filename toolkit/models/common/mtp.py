"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 section 2.2): ``--mtp-depth D`` sequential modules after
the decoder, each predicting one token further ahead with the model's own embedding and output head.

Depth k (1..D) at position t joins the previous depth's hidden state h^{k-1}_t (h^0: the decoder's residual stream,
before its final norm) with the embedding of the token k positions ahead, t_{t+k}:
``eh_proj([enorm(embed(t_{t+k})); hnorm(h^{k-1}_t)])`` (the embedding first, as DeepSeek's checkpoints store
``eh_proj``), runs one decoder block over it (causal, the same rotary positions), and predicts t_{t+k+1} through
its own final norm (Hugging Face's ``shared_head.norm``) and the shared output head. The embedding and the head are
the main model's parameters (DeepSeek-V3 shares them; its checkpoints hold copies, ``shared_head.head`` and
``embed_tokens``, which the family's Hugging Face adapter drops on import and writes back on export).

The loss (``mtp_loss``): per depth, the mean cross-entropy over the positions that have a token k+1 ahead (padding
and the last k+1 positions of a sequence count nothing); the mean over the depths; added to the training loss
times ``--mtp-loss-coef`` through the model's auxiliary losses (``toolkit.models.outputs``), so it is logged as its
own term and left out of ``loss``/``ppl``. Training only: evaluation, generation and ``eval-lm`` run the decoder
alone.

The tokens ahead are the sample's targets shifted (``target[t + k - 1]`` is t_{t+k}). Under context parallelism a
rank holds two chunks of each sequence and the tokens ahead of a chunk's last positions are in the next chunk: the
shard carries the whole target row (``ContextShard.target``) and each rank takes its columns shifted by k; the
means are taken over every cp rank's positions (the sums all-reduced, their gradient summed back), so each rank's
term equals one process's on the whole sequence.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.models.common.moe import sum_over_ranks


class PredictionDepth(nn.Module):
    """One depth: the two norms and the joining projection (``enorm``, ``hnorm``, ``eh_proj``: Hugging Face's
    names), a decoder block (``layer``) and the norm before the shared head (``norm``)."""

    def __init__(self, width: int, block: nn.Module, norm: Callable[[], nn.Module]):
        super().__init__()
        self.enorm = norm()
        self.hnorm = norm()
        self.eh_proj = nn.Linear(2 * width, width, bias=False)
        self.layer = block
        self.norm = norm()

    def forward(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_mask: Any = None,
        context_parallel: Any = None,
    ) -> torch.Tensor:
        """h^k [B, T, C] from h^{k-1} and the embeddings of the tokens k ahead (both [B, T, C])."""
        joined = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.layer(joined, cos, sin, attn_mask=attn_mask, context_parallel=context_parallel)


def tokens_ahead(target: torch.Tensor, shift: int, pad: int, context_parallel: Any = None) -> torch.Tensor:
    """``target[:, t + shift]`` at each of the model's positions t ([B, T]), ``pad`` past the end of the sequence;
    under context parallelism from the shard's whole target row (``context_parallel.target``) at this rank's
    columns (``context_parallel.query_index``)."""
    if context_parallel is None:
        return F.pad(target[:, shift:], (0, shift), value=pad) if shift else target
    whole = context_parallel.target
    columns = context_parallel.query_index + shift
    inside = columns < whole.size(1)
    ahead = whole[:, columns.clamp(max=whole.size(1) - 1)]
    return torch.where(inside, ahead, torch.full_like(ahead, pad))


def multi_token_loss(
    depths: nn.ModuleList,
    hidden: torch.Tensor,
    target: torch.Tensor,
    embed: Callable[[torch.Tensor], torch.Tensor],
    summed_nll: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    pad: int,
    block_inputs: tuple,
    context_parallel: Any = None,
) -> torch.Tensor:
    """The mean over ``depths`` of each depth's mean cross-entropy of the token k+1 ahead (0-dim, in the graph).

    ``hidden``: the decoder's output before its final norm; ``embed``: the model's token embedding;
    ``summed_nll(x, labels)``: the summed cross-entropy of the shared head on ``x`` (padding labels ignored);
    ``block_inputs``: (cos, sin, attn_mask) of the decoder's blocks."""
    cos, sin, mask = block_inputs
    group = None if context_parallel is None else context_parallel.group
    losses = []
    for k, depth in enumerate(depths, start=1):
        embedded = embed(tokens_ahead(target, k - 1, pad, context_parallel))
        hidden = depth(hidden, embedded, cos, sin, attn_mask=mask, context_parallel=context_parallel)
        labels = tokens_ahead(target, k, pad, context_parallel)
        nll = summed_nll(depth.norm(hidden), labels)
        count = labels.ne(pad).sum().to(nll.dtype)
        nll, count = sum_over_ranks(nll, None, group), sum_over_ranks(count, None, group)
        losses.append(nll / count.clamp(min=1.0))
    return torch.stack(losses).mean()
