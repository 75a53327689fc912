"""``--criterion cross_entropy``: summed next-token NLL, fairseq's reporting.

The trainer runs the model and hands its output here (``toolkit.core.protocols.Criterion``):

* ``model_requests(model, sample, reduce)``: what the loss asks the model to compute beside its usual output,
  added to the model's keyword arguments: ``loss_target`` for a fused head and loss (below), else nothing.
* ``criterion(net_output, sample, reduce)`` -> ``(loss, sample_size, logging_output)``, from the model's output
  (logits [B, T, V], fairseq's ``(logits, extra)``, or the fused head's summed NLL) and the sample's targets;
  the model is not needed, so a pipeline schedule can call it on the last stage's output:

  * ``loss``: the *sum* over non-pad target tokens of -log p(target) in nats, computed in fp32 whatever the
    logits' dtype (per token, [B*T], when not ``reduce``). The trainer divides gradients by the summed
    ``sample_size`` of the update (fairseq's normalization).
  * ``sample_size``: ``sample["ntokens"]`` (``nsentences`` with ``--sentence-avg``), an int.
  * ``logging_output``: ``{"loss": loss.detach() (a 0-dim fp32 tensor on the model's device), "ntokens": int,
    "nsentences": int, "sample_size": int}``. The loss stays a tensor so that micro-batches can be summed on
    the device and read with one ``.item()`` (or ``float()``) per update instead of one sync per micro-batch.

The output layer and the loss are fused (``--head-loss-chunk-rows N``, default 512; ``toolkit.models.fused_loss``)
when the model offers it (``supports_fused_loss``: ``transformer_lm``, ``llama``, ``moe``): ``model_requests``
asks for ``loss_target=`` and the model returns the summed NLL, computed N tokens at a time (softmax and its
gradient per chunk), so the [B*T, V] fp32 logits and their gradient never exist whole. The same sum, to fp32
rounding (``tests/unit/test_fused_loss.py``). The logits path stays where fusing cannot apply: ``--z-loss-coef``
(it needs logsumexp per token beside the NLL), ``reduce=False`` (per-token losses), ``--head-loss-chunk-rows 0``,
and whatever the model itself declines (an adaptive softmax, a vocabulary split over tensor-parallel ranks, a
logit soft-cap, fp16 with its loss scale): the model then returns its logits and the loss is computed from them
here.

A batch with ``sample["is_dummy"]`` (padding of a short data shard, see
:mod:`toolkit.data.iterators`) still runs forward and backward, but its loss is
multiplied by 0 and its ``sample_size``/``ntokens``/``nsentences`` are 0.

``--z-loss-coef c`` (PaLM, https://arxiv.org/abs/2204.02311, section 5) adds ``c * logsumexp(logits)**2`` summed
over the non-pad target tokens to the training loss, normalized by ``sample_size`` like the cross-entropy (so per
token by default). It is logged as ``z_loss``: that mean of ``logsumexp**2`` without the coefficient, in nats
squared (not converted to base 2 as ``loss`` is). ``loss``, ``nll_loss`` and ``ppl`` stay the cross-entropy's.

A model's auxiliary losses and metrics (``(logits, extra)``, see :mod:`toolkit.models.outputs`) are added
to the training loss with their coefficients and logged each under its name; ``loss`` stays the
cross-entropy.

``reduce_metrics(logging_outputs)`` sums the outputs and reports fairseq's numbers:
``loss`` = loss_sum / sample_size / ln 2 (base 2), ``nll_loss`` per token when
``sample_size != ntokens``, ``ppl`` = 2 ** (nll_)loss. It logs them to
:mod:`toolkit.logging.metrics` and also returns them as a dict.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F

from toolkit.core.errors import UserError
from toolkit.core.registry import register_criterion
from toolkit.models.fused_loss import LossTarget
from toolkit.models.outputs import aux_losses_of, metrics_of, summed_nll_of
from toolkit.config.components import CrossEntropyCriterionConfig  # noqa: F401  (its options, torch-free for --help)

# logging-output keys of the criterion itself (and what reduce_metrics derives); any other is a model's extra
_NOT_EXTRAS = frozenset({"loss", "nll_loss", "ppl", "ntokens", "nsentences", "sample_size"})


def _to_float(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


# fairseq's name under --model-parallel-size: the same loss here. With vocabulary-sharded logits
# (a DTensor from toolkit.distributed.tensor_parallel) F.cross_entropy runs under torch's
# loss_parallel(), which the trainer enters around forward and backward, without gathering the logits.
@register_criterion("vocab_parallel_cross_entropy", dataclass=CrossEntropyCriterionConfig)
@register_criterion("cross_entropy", dataclass=CrossEntropyCriterionConfig)
class CrossEntropyCriterion(torch.nn.Module):
    def __init__(self, task, cfg: CrossEntropyCriterionConfig = None):
        super().__init__()
        self.task = task
        self.cfg = cfg if cfg is not None else CrossEntropyCriterionConfig()
        self.sentence_avg = bool(self.cfg.sentence_avg)
        self.padding_idx = task.target_dictionary.pad()
        self.z_loss_coef = float(self.cfg.z_loss_coef)
        self.head_loss_chunk_rows = int(self.cfg.head_loss_chunk_rows)

    @staticmethod
    def logits_of(net_output: Any) -> torch.Tensor:
        """The [B, T, V] logits of a model's output (a tensor, or fairseq's ``(logits, extra)``)."""
        return net_output[0] if isinstance(net_output, (tuple, list)) else net_output

    def compute_loss(self, logits: torch.Tensor, target: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """NLL in nats of ``target`` under ``logits``, fp32, padding ignored (summed if ``reduce``)."""
        loss = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(),
            target.reshape(-1),
            ignore_index=self.padding_idx,
            reduction="sum" if reduce else "none",
        )
        # vocabulary-parallel logits give a loss replicated over the model-parallel ranks: its local value
        return loss.to_local() if hasattr(loss, "to_local") else loss

    def model_requests(self, model, sample: Dict[str, Any], reduce: bool = True) -> Dict[str, Any]:
        """The fused head's ``loss_target`` where ``model`` offers it and fusing applies (``fuses_head_loss``); the
        targets themselves to a training model that predicts further ahead (``reads_targets``: multi-token
        prediction, ``toolkit.models.common.mtp``)."""
        requests: Dict[str, Any] = {}
        if reduce and self.fuses_head_loss(model):
            requests["loss_target"] = LossTarget(sample["target"], self.padding_idx, self.head_loss_chunk_rows)
        if reduce and model.training and getattr(model, "reads_targets", False):
            requests["target"] = sample["target"]
        return requests

    def forward(
        self, net_output: Any, sample: Dict[str, Any], reduce: bool = True
    ) -> Tuple[torch.Tensor, int, Dict[str, Any]]:
        summed_nll = summed_nll_of(net_output)
        if summed_nll is not None:  # the model's fused head computed the loss (no z-loss then: fuses_head_loss)
            return self.with_model_extras(net_output, *self.with_counts(summed_nll, sample))
        logits = self.logits_of(net_output)
        if logits is None:  # fusing was asked for, but something between the family and here dropped its summed NLL
            raise UserError(
                f"--head-loss-chunk-rows {self.head_loss_chunk_rows}: the model's forward returned neither "
                f"logits nor its fused head's loss (a wrapper or override dropped the output's extras); pass "
                f"them through, or use --head-loss-chunk-rows 0"
            )
        counted = self.with_counts(self.compute_loss(logits, sample["target"], reduce=reduce), sample)
        if not reduce:
            return counted
        if self.z_loss_coef > 0:
            counted = self.with_z_loss(logits, sample, *counted)
        return self.with_model_extras(net_output, *counted)

    def fuses_head_loss(self, model) -> bool:
        """Whether to ask ``model`` for its fused head and loss: a family that offers it (through DDP's wrapper,
        which forwards attributes), fusing not switched off, and no z-loss (which reads every logsumexp)."""
        return (
            self.head_loss_chunk_rows > 0
            and self.z_loss_coef == 0
            and bool(getattr(model, "supports_fused_loss", False))
        )

    def with_z_loss(
        self,
        logits: torch.Tensor,
        sample: Dict[str, Any],
        loss: torch.Tensor,
        sample_size: int,
        logging_output: Dict[str, Any],
    ) -> Tuple[torch.Tensor, int, Dict[str, Any]]:
        """``loss + z_loss_coef * sum(logsumexp(logits)**2)`` over the non-pad target tokens, fp32; the sum is
        logged as ``z_loss`` (``reduce_metrics`` divides by ``sample_size`` as for ``loss``). A large normalizer
        lets logits drift, which bf16 rounds badly; the square pulls log Z towards 0."""
        log_z = torch.logsumexp(logits.float(), dim=-1)
        if hasattr(log_z, "full_tensor"):  # vocabulary-parallel logits: the normalizer, gathered over the vocabulary
            log_z = log_z.full_tensor()
        counted = sample["target"].ne(self.padding_idx)
        z_sum = torch.where(counted, log_z.square(), torch.zeros_like(log_z)).sum()
        if sample.get("is_dummy", False):
            z_sum = z_sum * 0.0
        logging_output["z_loss"] = z_sum.detach()
        return loss + self.z_loss_coef * z_sum, sample_size, logging_output

    @staticmethod
    def with_model_extras(
        net_output: Any, loss: torch.Tensor, sample_size: int, logging_output: Dict[str, Any]
    ) -> Tuple[torch.Tensor, int, Dict[str, Any]]:
        """The model's auxiliary losses added (``coefficient * value`` per unit of ``sample_size``, so the
        trainer's division by the update's sample size leaves ``coefficient * value``), each term and metric
        in the logging output as ``value * sample_size`` (summed like ``loss``, ``reduce_metrics`` divides);
        ``loss`` in the logging output stays the cross-entropy (``toolkit.models.outputs``)."""
        aux, model_metrics = aux_losses_of(net_output), metrics_of(net_output)
        for name in (*aux, *model_metrics):
            if name in logging_output or name in _NOT_EXTRAS:
                raise ValueError(
                    f"model output: the auxiliary term {name!r} has the name of a criterion output; rename it"
                )
        for name, (value, coefficient) in aux.items():
            weighted = value.float() * sample_size
            loss = loss + coefficient * weighted
            logging_output[name] = weighted.detach()
        for name, value in model_metrics.items():
            value = value.detach().float() if isinstance(value, torch.Tensor) else float(value)
            logging_output[name] = value * sample_size
        return loss, sample_size, logging_output

    def with_counts(self, loss: torch.Tensor, sample: Dict[str, Any]) -> Tuple[torch.Tensor, int, Dict[str, Any]]:
        """(loss, sample_size, logging_output) as fairseq's criterions return them; a dummy batch counts nothing."""
        if sample.get("is_dummy", False):
            loss = loss * 0.0
            ntokens = nsentences = sample_size = 0
        else:
            ntokens = int(sample["ntokens"])
            # a context-parallel shard counts its rows on one cp rank only (the rows are split over the cp ranks)
            nsentences = int(sample.get("nsentences", sample["target"].size(0)))
            sample_size = nsentences if self.sentence_avg else ntokens
        logging_output = {
            "loss": loss.detach(),
            "ntokens": ntokens,
            "nsentences": nsentences,
            "sample_size": sample_size,
        }
        return loss, sample_size, logging_output

    @staticmethod
    def _sums(logging_outputs: Sequence[Dict[str, Any]]) -> Tuple[float, float, float, float]:
        def total(key: str) -> float:
            return _to_float(sum(log.get(key, 0) for log in logging_outputs))  # one sync at most

        return total("loss"), total("ntokens"), total("nsentences"), total("sample_size")

    @staticmethod
    def _derive(loss_sum: float, ntokens: float, nsentences: float, sample_size: float) -> Dict[str, float]:
        out = {
            "loss": loss_sum / sample_size / math.log(2) if sample_size > 0 else 0.0,
            "ntokens": ntokens,
            "nsentences": nsentences,
            "sample_size": sample_size,
        }
        per_token = out["loss"]
        if sample_size != ntokens:
            per_token = out["nll_loss"] = loss_sum / ntokens / math.log(2) if ntokens > 0 else 0.0
        try:
            out["ppl"] = 2.0**per_token
        except OverflowError:
            out["ppl"] = float("inf")
        return out

    @staticmethod
    def aggregate_logging_outputs(logging_outputs: Sequence[Dict[str, Any]]) -> Dict[str, float]:
        """Sums the outputs and derives fairseq's ``loss`` (base 2), ``nll_loss`` and ``ppl``."""
        return CrossEntropyCriterion._derive(*CrossEntropyCriterion._sums(logging_outputs))

    @staticmethod
    def _extras(logging_outputs: Sequence[Dict[str, Any]], sample_size: float) -> Dict[str, float]:
        """Each auxiliary loss and model metric as its ``sample_size``-weighted mean (see ``with_model_extras``)."""
        names = {k for log in logging_outputs for k in log if k not in _NOT_EXTRAS and not k.startswith("_")}
        return {
            name: _to_float(sum(log.get(name, 0) for log in logging_outputs)) / sample_size if sample_size > 0 else 0.0
            for name in sorted(names)
        }

    @staticmethod
    def reduce_metrics(logging_outputs: List[Dict[str, Any]]) -> Dict[str, float]:
        """Logs ``loss``/``nll_loss``/``ppl`` as fairseq does (weighted by sample_size), and each auxiliary
        term of the model under its name, and returns them."""
        loss_sum, ntokens, nsentences, sample_size = CrossEntropyCriterion._sums(logging_outputs)
        extras = CrossEntropyCriterion._extras(logging_outputs, sample_size)
        try:
            from toolkit.logging import metrics
        except ImportError:  # metrics not available: just return the numbers
            metrics = None
        if metrics is not None:
            metrics.log_loss_metrics(loss_sum, sample_size, ntokens)
            for name, value in extras.items():
                metrics.log_scalar(name, value, sample_size, round=4)
        return dict(CrossEntropyCriterion._derive(loss_sum, ntokens, nsentences, sample_size), **extras)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
