"""``--criterion adaptive_loss``: summed NLL under the model's adaptive softmax, fairseq's reporting.

The model returns features (``--adaptive-softmax-cutoff``); the loss is the head's cross
entropy (tail words count as their band's cluster) plus each tail band's cross entropy over
the positions whose target is in it, in nats, fp32 -- the exact log-likelihood of the target
under the factorized softmax. ``sample_size``, the logged fields (``loss``, ``ntokens``,
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
from toolkit.models.document_mask import packing_inputs


@register_criterion("adaptive_loss", dataclass=CrossEntropyCriterionConfig)
class AdaptiveLoss(CrossEntropyCriterion):
    def __init__(self, task, cfg: CrossEntropyCriterionConfig = None):
        super().__init__(task, cfg)
        if self.z_loss_coef > 0:
            raise UserError(
                "--z-loss-coef: the adaptive softmax never forms the whole vocabulary's logits, so it has "
                "no single normalizer to penalize; use --criterion cross_entropy for the z-loss"
            )

    def forward(self, model, sample: Dict[str, Any], reduce: bool = True) -> Tuple[torch.Tensor, int, Dict[str, Any]]:
        adaptive_softmax = model.adaptive_softmax
        if adaptive_softmax is None:
            raise UserError(
                "--criterion adaptive_loss: the model has no adaptive softmax; add "
                "--adaptive-softmax-cutoff (e.g. 20000,60000) or use --criterion cross_entropy"
            )
        features = self.logits_of(model(sample["net_input"]["src_tokens"], **packing_inputs(sample["net_input"])))
        return self.with_counts(
            adaptive_softmax.loss(features, sample["target"], self.padding_idx, reduce=reduce), sample
        )
