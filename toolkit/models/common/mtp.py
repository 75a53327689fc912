"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 section 2.2): ``--mtp-depth D`` sequential modules after
the decoder, each predicting one token further ahead with the model's own embedding and output head.

Depth k (1..D) at position t joins the previous depth's hidden state h^{k-1}_t (h^0: the decoder's output after its
final norm, what the head reads) with the embedding of the token k positions ahead, t_{t+k}:
``eh_proj([enorm(embed(t_{t+k})); hnorm(h^{k-1}_t)])`` (the embedding first, as DeepSeek's, GLM's and Qwen3-Next's
checkpoints store the joining projection), runs one decoder block over it (causal, the same rotary positions) and
its own final norm (Hugging Face's ``shared_head.norm``, Qwen3-Next's ``mtp.norm``): h^k, which predicts t_{t+k+1}
through the shared output head and is the next depth's input. This is Megatron's MultiTokenPredictionBlock (the
decoder's final norm before depth 1, each depth's norm before the head and the next depth) and what vLLM's and
SGLang's speculative decoders feed the released MTP layers (the target model's normed hidden state). The embedding
and the head are the main model's parameters (DeepSeek-V3 shares them; its checkpoints hold copies,
``shared_head.head`` and ``embed_tokens``, which the family's Hugging Face adapter drops on import and writes back on
export).

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

``MultiTokenPrediction`` is what a family mixes in (DeepSeek-V3, GLM-4.5, Qwen3-Next): the depths, their loss in
training, the hooks into the decoder's forward and head.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.models.common.attention import attention_mask
from toolkit.models.common.moe import sum_over_ranks
from toolkit.models.common.options import head_dim
from toolkit.models.fused_loss import LossTarget
from toolkit.models.outputs import summed_nll_of, with_aux_loss

DEPTH = re.compile(r"mtp\.(\d+)\.")  # a depth's entries in a state dict
MTP_INPUTS = ("document_ids", "positions", "context_parallel")  # forward's inputs the depths' blocks take too


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
        """h^k [B, T, C] (after the depth's norm) from h^{k-1} and the embeddings of the tokens k ahead (both
        [B, T, C])."""
        joined = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.norm(self.layer(joined, cos, sin, attn_mask=attn_mask, context_parallel=context_parallel))


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
    counts: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The mean over ``depths`` of each depth's mean cross-entropy of the token k+1 ahead (0-dim, in the graph).

    ``hidden``: the decoder's output after its final norm; ``embed``: the model's token embedding;
    ``summed_nll(x, labels)``: the summed cross-entropy of the shared head on ``x`` (padding labels ignored);
    ``block_inputs``: (cos, sin, attn_mask) of the decoder's blocks; ``counts``: each depth's divisor [D] where
    ``hidden`` is a part of the sample the mean is over (a pipeline's micro-batch: the sample's labels per depth,
    :func:`label_counts`; under context parallelism of the whole rows), else the labels of ``hidden``'s positions
    (over every cp rank)."""
    cos, sin, mask = block_inputs
    group = None if context_parallel is None else context_parallel.group
    losses = []
    for k, depth in enumerate(depths, start=1):
        embedded = embed(tokens_ahead(target, k - 1, pad, context_parallel))
        hidden = depth(hidden, embedded, cos, sin, attn_mask=mask, context_parallel=context_parallel)
        labels = tokens_ahead(target, k, pad, context_parallel)
        nll = sum_over_ranks(summed_nll(hidden, labels), None, group)
        if counts is None:
            count = sum_over_ranks(labels.ne(pad).sum().to(nll.dtype), None, group)
        else:
            count = counts[k - 1].to(nll.dtype)
        losses.append(nll / count.clamp(min=1.0))
    return torch.stack(losses).mean()


def label_counts(target: torch.Tensor, depths: int, pad: int) -> torch.Tensor:
    """Each depth's count of labels in ``target`` [B, T] (the positions with a token k+1 ahead), [depths]."""
    return torch.stack([tokens_ahead(target, k, pad).ne(pad).sum() for k in range(1, depths + 1)])


class MultiTokenPrediction:
    """What a rotary decoder family with ``--mtp-depth`` adds (a mixin before its base class): the depths under
    ``mtp`` (``mtp.{k}.layer``: ``prediction_block``'s block, by default the block of the next layer index), their
    loss in training when the criterion passes the targets (``reads_targets``), an auxiliary term ``mtp_loss`` beside
    the family's others. The decoder's own forward is ``decoder_forward`` (the base class's unless the family
    overrides it); ``output`` runs the depths on the decoder's last hidden states when ``forward`` asked for them."""

    def build_extra_modules(self, cfg: Any) -> None:
        """The depths: depth k's block is ``prediction_block(cfg, k)`` (0-based k)."""
        self.mtp = nn.ModuleList(
            PredictionDepth(cfg.decoder_embed_dim, self.prediction_block(cfg, k), self.width_norm)
            for k in range(cfg.mtp_depth)
        )
        self._mtp_inputs: Optional[Dict[str, Any]] = None
        self._mtp_loss: Optional[torch.Tensor] = None

    def prediction_block(self, cfg: Any, k: int) -> nn.Module:
        """Depth k's block: layer ``decoder_layers + k``'s (DeepSeek-V3's and GLM-4.5's are MoE layers)."""
        return self.build_block(cfg, cfg.decoder_layers + k, None)

    @property
    def reads_targets(self) -> bool:
        """Whether the criterion passes the targets to ``forward`` (``target=``): the depths' labels."""
        return len(self.mtp) > 0

    def forward(self, tokens: torch.Tensor, *args: Any, target: Optional[torch.Tensor] = None, **kwargs: Any):
        """``decoder_forward`` (its arguments as it takes them); in training, given ``target`` [B, T] (the next
        tokens, the criterion's) and depths, their loss beside the decoder's terms. The trainer passes the batch's
        inputs by keyword, as read here."""
        if self.training and target is not None and len(self.mtp) and not args and not kwargs.get("incremental_state"):
            self._mtp_inputs = dict(target=target, **{k: kwargs.get(k) for k in MTP_INPUTS})
        try:
            out = self.decoder_forward(tokens, *args, **kwargs)
        finally:
            self._mtp_inputs, loss, self._mtp_loss = None, self._mtp_loss, None
        return out if loss is None else with_aux_loss(out, "mtp_loss", loss, self.cfg.mtp_loss_coef)

    def decoder_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The decoder's forward without the depths: the base class's."""
        return super().forward(*args, **kwargs)

    def output(self, x: torch.Tensor, loss_target: Optional[LossTarget] = None) -> Any:
        """The shared head on the decoder's output; before it, when ``forward`` asked for it, the depths' loss from
        the same hidden states after the final norm (the head's input)."""
        if self._mtp_inputs is not None:
            self._mtp_loss = self.multi_token_loss(self.norm(x), **self._mtp_inputs)
        return super().output(x, loss_target)

    def multi_token_loss(
        self, hidden: torch.Tensor, target, document_ids, positions, context_parallel, counts=None
    ) -> torch.Tensor:
        """``multi_token_loss`` with this model's embedding, head, rotary rows and mask (``counts``: the divisors of
        a part of the sample, :func:`multi_token_loss`)."""
        T = hidden.size(1)
        cos, sin = self.rope_rows(None, 0, T, positions)
        mask = None
        if context_parallel is None:
            mask = attention_mask(document_ids, T, hidden.device, head_dim=head_dim(self.cfg))
        inputs = (cos, sin, mask)
        return multi_token_loss(
            self.mtp, hidden, target, self.embed, self.head_nll, self.padding_idx, inputs, context_parallel, counts
        )

    def head_nll(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy of ``labels`` under the shared head on ``x`` (padding ignored): fused where the
        head allows it (``fused_head_loss``), else from the logits (vocabulary-parallel ones under ``loss_parallel``)."""
        weight = self.embed_tokens.weight if self.output_projection is None else self.output_projection.weight
        fused = self.fused_head_loss(x, weight, LossTarget(labels, self.padding_idx))
        if fused is not None:
            return summed_nll_of(fused)
        logits = F.linear(x, weight) if self.output_projection is None else self.output_projection(x)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(),
            labels.reshape(-1),
            ignore_index=self.padding_idx,
            reduction="sum",
        )
        return loss.to_local() if hasattr(loss, "to_local") else loss

    def initial_value(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """The family's rules; the depths' joining projections as the other projections."""
        if name.endswith("eh_proj.weight"):
            return torch.empty(shape).normal_(0.0, self.cfg.init_std, generator=generator)
        return super().initial_value(name, shape, generator)


def finetuning_depths(model: nn.Module, state: Dict[str, Any]) -> Tuple[Dict[str, Any], Optional[str]]:
    """The weights a fine-tuning start (``--finetune-from-model``) loads into ``model`` as to its depths, and a line
    saying what became of them (None: the checkpoint and the run have the same). The depths are trained only, so a
    run may fine-tune without some or all of a checkpoint's (DeepSeek-V3's or an imported folder's into
    ``--mtp-depth 0``): those past the run's ``--mtp-depth`` are left out; a run's depths the checkpoint lacks
    start from the run's own initialization. ``model``'s entries as ``get_model_state_dict`` gives them."""
    theirs = {int(m.group(1)) for m in map(DEPTH.match, state) if m is not None}
    ours = set(range(len(getattr(model, "mtp", ()))))
    if theirs == ours:
        return state, None
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    kept = {k: v for k, v in state.items() if (m := DEPTH.match(k)) is None or int(m.group(1)) in ours}
    own = get_model_state_dict(model) if ours - theirs else {}
    fresh = {k: v for k, v in own.items() if (m := DEPTH.match(k)) is not None and int(m.group(1)) not in theirs}
    line = f"its {len(theirs)} multi-token prediction depths, this run's --mtp-depth {len(ours)}: "
    if theirs - ours:
        line += f"{len(theirs - ours)} left out (give --mtp-depth {len(theirs)} to train them on)"
    if ours - theirs:
        line += f"{'; ' if theirs - ours else ''}{len(ours - theirs)} start from this run's initialization"
    return {**kept, **fresh}, line
