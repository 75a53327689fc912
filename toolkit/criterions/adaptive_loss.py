"""``--criterion adaptive_loss``: summed NLL under the model's adaptive softmax, fairseq's reporting.

The adaptive softmax (``--adaptive-softmax-cutoff``) is the model's head, so the model computes the loss when
asked (``model_requests``: ``loss_target``) and returns the summed NLL, as a fused head does: the head's cross
entropy (tail words count as their band's cluster) plus each tail band's cross entropy over the positions whose
target is in it, in nats, fp32 -- the exact log-likelihood of the target under the factorized softmax. The loss
itself never needs the model (``toolkit.core.protocols.Criterion``). ``sample_size``, the logged fields (``loss``, ``ntokens``,
``nsentences``, ``sample_size``) and the reported ``loss`` / ``nll_loss`` / ``ppl`` are
``cross_entropy``'s, which are fairseq's adaptive_loss's.

Unlike fairseq, ``--ddp-backend c10d`` works: every tail band runs, on zero rows when it has no
target, so every parameter gets a gradient (see toolkit.models.adaptive).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from toolkit.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from toolkit.core.errors import UserError
from toolkit.core.registry import register_criterion
from toolkit.models.fused_loss import LossTarget
from toolkit.models.outputs import summed_nll_of


@register_criterion("adaptive_loss", dataclass=CrossEntropyCriterionConfig)
class AdaptiveLoss(CrossEntropyCriterion):
    def __init__(self, task, cfg: CrossEntropyCriterionConfig = None):
        super().__init__(task, cfg)
        if self.z_loss_coef > 0:
            raise UserError(
                "--z-loss-coef: the adaptive softmax never forms the whole vocabulary's logits, so it has "
                "no single normalizer to penalize; use --criterion cross_entropy for the z-loss"
            )

    def model_requests(self, model, sample: Dict[str, Any], reduce: bool = True) -> Dict[str, Any]:
        """``loss_target``: the model's adaptive softmax scores the targets (its summed NLL)."""
        if getattr(model, "adaptive_softmax", None) is None:
            raise UserError(
                "--criterion adaptive_loss: the model has no adaptive softmax; add "
                "--adaptive-softmax-cutoff (e.g. 20000,60000) or use --criterion cross_entropy"
            )
        if not reduce:
            raise ValueError(
                "adaptive_loss: per-token losses (reduce=False) are not computed by the model's adaptive softmax "
                "head; score positions with model.get_normalized_probs"
            )
        return {"loss_target": LossTarget(sample["target"], self.padding_idx, self.head_loss_chunk_rows)}

    def forward(
        self, net_output: Any, sample: Dict[str, Any], reduce: bool = True
    ) -> Tuple[torch.Tensor, int, Dict[str, Any]]:
        summed_nll = summed_nll_of(net_output)
        if summed_nll is None:
            raise UserError(
                "--criterion adaptive_loss: the model returned no adaptive-softmax loss (its forward was not given "
                "the criterion's loss_target, or a wrapper dropped the output's extras)"
            )
        return self.with_model_extras(net_output, *self.with_counts(summed_nll, sample))
