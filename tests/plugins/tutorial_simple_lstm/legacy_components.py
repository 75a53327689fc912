# A task and a criterion written the way fairseq plugins are (legacy add_args, FairseqCriterion's
# __init__ filled by name, reduce_metrics through the metrics module), imports renamed fairseq -> toolkit.
# The criterion is fairseq's cross_entropy with a weight on the loss.
import math

import torch.nn.functional as F

from toolkit import utils
from toolkit.criterions import FairseqCriterion, register_criterion
from toolkit.logging import metrics
from toolkit.tasks import register_task
from toolkit.tasks.language_modeling import LanguageModelingTask


@register_task("language_modeling_with_tag")
class LanguageModelingWithTagTask(LanguageModelingTask):
    @staticmethod
    def add_args(parser):
        parser.add_argument("--run-tag", type=str, default="none", help="a label kept in the task options")


@register_criterion("weighted_cross_entropy")
class WeightedCrossEntropyCriterion(FairseqCriterion):
    @staticmethod
    def add_args(parser):
        parser.add_argument("--loss-weight", type=float, default=1.0, help="factor on the summed loss")

    def __init__(self, task, loss_weight):
        super().__init__(task)
        self.loss_weight = loss_weight

    def forward(self, model, sample, reduce=True):
        net_output = model(**sample["net_input"])
        lprobs = model.get_normalized_probs(net_output, log_probs=True)
        lprobs = lprobs.view(-1, lprobs.size(-1))
        target = model.get_targets(sample, net_output).view(-1)
        loss = self.loss_weight * F.nll_loss(
            lprobs, target, ignore_index=self.padding_idx, reduction="sum" if reduce else "none"
        )
        sample_size = sample["ntokens"]
        logging_output = {
            "loss": loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        return loss, sample_size, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        loss_sum = sum(log.get("loss", 0) for log in logging_outputs)
        sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
        metrics.log_scalar("loss", loss_sum / sample_size / math.log(2), sample_size, round=3)
        metrics.log_derived("ppl", lambda meters: utils.get_perplexity(meters["loss"].avg))

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
