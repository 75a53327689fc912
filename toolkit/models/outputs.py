"""What a model may return beside its logits: auxiliary losses and metrics for the criterion to add and log.

A model's ``forward`` returns logits, or fairseq's ``(logits, extra)`` with ``extra`` a dict. Two keys of
``extra`` reach training (``with_extras`` builds them):

- ``"aux_losses"``: ``{name: (value, coefficient)}``, ``value`` a 0-dim tensor in the graph (a MoE
  router's load-balancing loss, a z-loss). ``value`` is a *mean* (per token, or per batch: whatever
  the term is defined as); the criterion adds ``coefficient * value`` per unit of ``sample_size`` to the
  training loss, so the gradient of the update is ``coefficient * d value`` beside the cross-entropy's,
  whatever the number of micro-batches and ranks;
- ``"metrics"``: ``{name: value}``, numbers to log (an expert's load, the router's entropy), not trained on.

A model asked for its loss (``forward(..., loss_target=LossTarget(...))``, ``toolkit.models.fused_loss``) returns
``(None, extra)`` with ``extra["summed_nll"]`` the summed cross-entropy in place of the logits (``with_summed_nll``),
or its usual output where its head cannot be fused; ``summed_nll_of`` tells the criterion which.

Each name is logged under itself (``aux_loss``, ``z_loss``) in the log lines and TensorBoard, as the
``sample_size``-weighted mean of the values (before the coefficient, in nats); ``loss`` and ``ppl`` stay
the cross-entropy alone, in training and in validation.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

import torch

AUX_LOSSES = "aux_losses"
METRICS = "metrics"
SUMMED_NLL = "summed_nll"


def with_extras(
    logits: torch.Tensor,
    aux_losses: Optional[Mapping[str, Tuple[torch.Tensor, float]]] = None,
    metrics: Optional[Mapping[str, Any]] = None,
    **extra: Any,
) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """``(logits, extra)`` with the auxiliary losses and metrics where the criterion reads them."""
    return logits, dict(extra, **{AUX_LOSSES: dict(aux_losses or {}), METRICS: dict(metrics or {})})


def with_aux_loss(net_output: Any, name: str, value: torch.Tensor, coefficient: float) -> Tuple[Any, Dict[str, Any]]:
    """``net_output`` (logits, or ``(logits, extra)``) with one more auxiliary loss, its other extras kept."""
    extra = dict(_extra(net_output))
    logits = net_output[0] if extra else net_output
    extra[AUX_LOSSES] = {**(extra.get(AUX_LOSSES) or {}), name: (value, coefficient)}
    extra.setdefault(METRICS, {})
    return logits, extra


def _extra(net_output: Any) -> Mapping[str, Any]:
    if isinstance(net_output, (tuple, list)) and len(net_output) > 1 and isinstance(net_output[1], Mapping):
        return net_output[1]
    return {}


def aux_losses_of(net_output: Any) -> Dict[str, Tuple[torch.Tensor, float]]:
    """The ``{name: (value, coefficient)}`` a model's output carries (none for plain logits)."""
    return dict(_extra(net_output).get(AUX_LOSSES) or {})


def metrics_of(net_output: Any) -> Dict[str, Any]:
    """The ``{name: value}`` metrics a model's output carries."""
    return dict(_extra(net_output).get(METRICS) or {})


def with_summed_nll(summed_nll: torch.Tensor) -> Tuple[None, Dict[str, Any]]:
    """``(None, extra)``: the fused head's summed NLL where the logits would be."""
    return with_extras(None, **{SUMMED_NLL: summed_nll})


def summed_nll_of(net_output: Any) -> Optional[torch.Tensor]:
    """The summed NLL a model computed itself (its fused head and loss), or None when it returned logits."""
    return _extra(net_output).get(SUMMED_NLL)
