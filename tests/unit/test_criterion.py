import math
from types import SimpleNamespace

import pytest
import torch

from toolkit.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from toolkit.data.dictionary import Dictionary
from toolkit.train.trainer import forward_and_loss

PAD = 1


class FixedLogits(torch.nn.Module):
    """Returns given logits (optionally fairseq-style as ``(logits, extra)``) and records its input."""

    def __init__(self, logits, as_tuple=False):
        super().__init__()
        self.logits = torch.nn.Parameter(logits.clone())
        self.as_tuple = as_tuple

    def forward(self, src_tokens):
        self.seen = src_tokens
        return (self.logits, {"attn": None}) if self.as_tuple else self.logits


def make_criterion(sentence_avg=False):
    task = SimpleNamespace(target_dictionary=Dictionary())
    return CrossEntropyCriterion(task, CrossEntropyCriterionConfig(sentence_avg=sentence_avg))


def make_sample(target):
    target = torch.tensor(target)
    return {
        "id": torch.arange(target.size(0)),
        "nsentences": target.size(0),
        "ntokens": int(target.ne(PAD).sum()),
        "net_input": {"src_tokens": target.clone(), "src_lengths": target.ne(PAD).sum(1)},
        "target": target,
    }


def hand_nll(logits, target):
    total = 0.0
    for b in range(len(target)):
        for t in range(len(target[b])):
            y = target[b][t]
            if y == PAD:
                continue
            row = [float(x) for x in logits[b, t]]
            total += math.log(sum(math.exp(x) for x in row)) - row[y]
    return total


TARGET = [[4, 5, 2], [6, PAD, PAD]]


@pytest.mark.parametrize("as_tuple", [False, True])
def test_loss_is_summed_nll_ignoring_padding(as_tuple):
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 8)
    crit = make_criterion()
    loss, sample_size, log = forward_and_loss(FixedLogits(logits, as_tuple), crit, make_sample(TARGET))
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert loss.item() == pytest.approx(hand_nll(logits, TARGET), rel=1e-6)
    assert sample_size == 4
    assert log["ntokens"] == 4 and log["nsentences"] == 2 and log["sample_size"] == 4
    assert isinstance(log["loss"], torch.Tensor) and not log["loss"].requires_grad
    assert log["loss"].item() == pytest.approx(loss.item())


def test_padding_logits_do_not_matter_and_get_no_gradient():
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 8)
    changed = logits.clone()
    changed[1, 1:] = 100.0  # positions whose target is padding
    crit = make_criterion()
    a, _, _ = forward_and_loss(FixedLogits(logits), crit, make_sample(TARGET))
    model = FixedLogits(changed)
    b, _, _ = forward_and_loss(model, crit, make_sample(TARGET))
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    b.backward()
    assert model.logits.grad[1, 1:].abs().sum() == 0 and model.logits.grad[0].abs().sum() > 0


def test_sentence_avg():
    logits = torch.zeros(2, 3, 8)
    loss, sample_size, log = forward_and_loss(
        FixedLogits(logits), make_criterion(sentence_avg=True), make_sample(TARGET)
    )
    assert sample_size == 2 and log["sample_size"] == 2 and log["ntokens"] == 4
    assert loss.item() == pytest.approx(4 * math.log(8), rel=1e-6)


def test_low_precision_logits_are_scored_in_fp32():
    torch.manual_seed(2)
    logits = torch.randn(2, 3, 8).to(torch.bfloat16)
    loss, _, _ = forward_and_loss(FixedLogits(logits), make_criterion(), make_sample(TARGET))
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(hand_nll(logits.float(), TARGET), rel=1e-6)


def test_dummy_batch_has_zero_weight_but_runs_backward():
    logits = torch.randn(2, 3, 8)
    sample = dict(make_sample(TARGET), is_dummy=True, ntokens=0, nsentences=0)
    model = FixedLogits(logits)
    loss, sample_size, log = forward_and_loss(model, make_criterion(), sample)
    assert loss.item() == 0.0 and sample_size == 0
    assert (log["ntokens"], log["nsentences"], log["sample_size"], log["loss"].item()) == (0, 0, 0, 0.0)
    loss.backward()
    assert model.logits.grad is not None and model.logits.grad.abs().sum() == 0


@pytest.fixture
def isolated_metrics():
    """Values logged by reduce_metrics go to a private aggregator, not the session's "default"."""
    from toolkit.logging import metrics

    with metrics.aggregate(new_root=True) as agg:
        yield agg


def test_reduce_metrics_reports_base2_loss_and_ppl(isolated_metrics):
    ln2 = math.log(2)
    logs = [
        {"loss": torch.tensor(10.0), "ntokens": 4, "nsentences": 2, "sample_size": 4},
        {"loss": torch.tensor(6.0), "ntokens": 4, "nsentences": 1, "sample_size": 4},
        {"loss": torch.tensor(0.0), "ntokens": 0, "nsentences": 0, "sample_size": 0},
    ]  # a dummy
    out = CrossEntropyCriterion.reduce_metrics(logs)
    assert out["loss"] == pytest.approx(16.0 / 8 / ln2)
    assert out["ppl"] == pytest.approx(2 ** (16.0 / 8 / ln2))
    assert (out["ntokens"], out["nsentences"], out["sample_size"]) == (8, 3, 8)
    assert "nll_loss" not in out
    logged = isolated_metrics.get_smoothed_values()
    assert logged["loss"] == pytest.approx(round(16.0 / 8 / ln2, 3)) and logged["ppl"] == pytest.approx(
        out["ppl"], abs=0.01
    )
    # plain floats work as well; with --sentence-avg the per-token nll_loss drives ppl
    out = CrossEntropyCriterion.reduce_metrics([{"loss": 12.0, "ntokens": 6, "nsentences": 2, "sample_size": 2}])
    assert out["loss"] == pytest.approx(12.0 / 2 / ln2) and out["nll_loss"] == pytest.approx(12.0 / 6 / ln2)
    assert out["ppl"] == pytest.approx(2 ** (12.0 / 6 / ln2))
    empty = CrossEntropyCriterion.aggregate_logging_outputs([])
    assert empty["loss"] == 0.0 and empty["sample_size"] == 0


def test_criterion_matches_uniform_model_ppl():
    """A model that is uniform over V words has perplexity exactly V."""
    V = 16
    logits = torch.zeros(3, 5, V)
    target = [[4, 5, 6, 7, 8], [9, 10, 2, PAD, PAD], [2, PAD, PAD, PAD, PAD]]
    _, _, log = forward_and_loss(FixedLogits(logits), make_criterion(), make_sample(target))
    out = CrossEntropyCriterion.aggregate_logging_outputs([log])
    assert out["loss"] == pytest.approx(math.log2(V)) and out["ppl"] == pytest.approx(V)


class Recording(torch.nn.Module):
    """A model that records the keyword arguments it was called with and returns fixed logits."""

    supports_fused_loss = True

    def __init__(self, logits):
        super().__init__()
        self.logits, self.calls = logits, []

    def forward(self, src_tokens, **kwargs):
        self.calls.append(kwargs)
        return self.logits


def test_the_trainer_runs_the_model_and_the_criterion_computes_from_its_outputs_alone():
    """The model gets the batch's packing inputs and what the criterion requests; the criterion gets the
    output, so the same loss comes from the logits without any model (a pipeline's last stage)."""
    torch.manual_seed(3)
    logits = torch.randn(2, 3, 8)
    sample = make_sample(TARGET)
    sample["net_input"]["document_ids"] = torch.zeros(2, 3, dtype=torch.long)
    crit = CrossEntropyCriterion(
        SimpleNamespace(target_dictionary=Dictionary()), CrossEntropyCriterionConfig(head_loss_chunk_rows=0)
    )
    model = Recording(logits)
    loss, sample_size, log = forward_and_loss(model, crit, sample)
    assert list(model.calls[0]) == ["document_ids"]  # src_lengths is not a model input; no fusing asked
    alone = crit(logits, sample)
    assert torch.equal(loss, alone[0]) and sample_size == alone[1] == 4
    assert crit.model_requests(model, sample, reduce=False) == {}
    fused = make_criterion().model_requests(model, sample)
    assert list(fused) == ["loss_target"] and fused["loss_target"].target is sample["target"]
    assert make_criterion().model_requests(torch.nn.Identity(), sample) == {}  # a model without a fused head


def test_a_fairseq_criterion_runs_the_model_itself():
    """fairseq's contract (forward(model, sample, reduce)): a FairseqCriterion, or a toolkit criterion's
    subclass overriding forward that way, is handed the model; the toolkit's own are handed outputs."""
    from toolkit.compat.fairseq.plugins.criterion import FairseqCriterion, calls_the_model

    class Legacy(FairseqCriterion):
        def forward(self, model, sample, reduce=True):
            loss = make_criterion().compute_loss(model(sample["net_input"]["src_tokens"]), sample["target"])
            return loss, sample["ntokens"], {"loss": loss.detach(), "ntokens": sample["ntokens"]}

    class Ported(CrossEntropyCriterion):
        def forward(self, model, sample, reduce=True):
            return super().forward(model(sample["net_input"]["src_tokens"]), sample, reduce)

    task = SimpleNamespace(target_dictionary=Dictionary())
    assert not calls_the_model(make_criterion())
    assert calls_the_model(Legacy(task)) and calls_the_model(Ported(task))
    torch.manual_seed(4)
    logits = torch.randn(2, 3, 8)
    model = FixedLogits(logits)
    want = hand_nll(logits, TARGET)
    for crit in (Legacy(task), Ported(task)):
        loss, sample_size, _ = forward_and_loss(model, crit, make_sample(TARGET))
        assert loss.item() == pytest.approx(want, rel=1e-6) and sample_size == 4
    assert isinstance(model.seen, torch.Tensor)
