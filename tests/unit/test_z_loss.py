"""``--z-loss-coef``: PaLM's z-loss against a direct computation (value and gradient), its normalization and
logging, and the cross-entropy it leaves alone."""

from types import SimpleNamespace

import pytest
import torch

from toolkit.core.errors import UserError
from toolkit.criterions.adaptive_loss import AdaptiveLoss
from toolkit.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
from toolkit.data.dictionary import Dictionary
from toolkit.train.trainer import forward_and_loss

PAD = 1
TARGET = [[4, 5, 2, 7], [6, 3, PAD, PAD]]


class FixedLogits(torch.nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(logits.clone())

    def forward(self, src_tokens):
        return self.logits


def criterion(coef, sentence_avg=False, cls=CrossEntropyCriterion):
    task = SimpleNamespace(target_dictionary=Dictionary())
    return cls(task, CrossEntropyCriterionConfig(sentence_avg=sentence_avg, z_loss_coef=coef))


def sample(target=TARGET, **extra):
    target = torch.tensor(target)
    return dict(
        {
            "nsentences": target.size(0),
            "ntokens": int(target.ne(PAD).sum()),
            "net_input": {"src_tokens": target.clone()},
            "target": target,
        },
        **extra,
    )


def direct(logits, target, coef):
    """Summed NLL + coef * sum of (log sum exp)^2 over the non-pad targets, written out token by token."""
    nll, z = 0.0, 0.0
    for b, row in enumerate(target):
        for t, y in enumerate(row):
            if y != PAD:
                log_z = torch.log(torch.exp(logits[b, t].double()).sum())
                nll = nll + log_z - logits[b, t, y].double()
                z = z + log_z**2
    return nll + coef * z, nll, z


@pytest.mark.parametrize("sentence_avg", [False, True])
def test_value_and_gradient_match_a_direct_computation(sentence_avg):
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 11) * 3 + 2  # a normalizer far from 1, so the z-loss is large
    model = FixedLogits(logits)
    loss, sample_size, log = forward_and_loss(model, criterion(0.03, sentence_avg), sample())
    loss.backward()
    leaf = logits.clone().double().requires_grad_()
    want, nll, z = direct(leaf, TARGET, 0.03)
    want.backward()
    assert sample_size == (2 if sentence_avg else 6)
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert log["loss"].item() == pytest.approx(nll.item(), rel=1e-6)  # the logged loss is the cross-entropy
    assert log["z_loss"].item() == pytest.approx(z.item(), rel=1e-6)
    torch.testing.assert_close(model.logits.grad.double(), leaf.grad, rtol=1e-5, atol=1e-6)
    assert model.logits.grad[1, 2:].abs().sum() == 0  # padding gets no gradient


def test_zero_coef_is_the_plain_cross_entropy_and_logs_nothing():
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 11)
    plain = forward_and_loss(
        FixedLogits(logits), CrossEntropyCriterion(SimpleNamespace(target_dictionary=Dictionary())), sample()
    )
    off = forward_and_loss(FixedLogits(logits), criterion(0.0), sample())
    on = forward_and_loss(FixedLogits(logits), criterion(1e-4), sample())
    assert torch.equal(off[0], plain[0]) and "z_loss" not in off[2]
    assert torch.equal(on[2]["loss"], plain[2]["loss"]) and on[0] > plain[0]


def test_reduce_metrics_reports_z_loss_per_token_and_loss_unchanged():
    from toolkit.logging import metrics

    torch.manual_seed(2)
    crit = criterion(1e-2)
    logs = [forward_and_loss(FixedLogits(torch.randn(2, 4, 11) * 2), crit, sample())[2] for _ in range(2)]
    logs.append(
        forward_and_loss(FixedLogits(torch.randn(2, 4, 11)), crit, sample(is_dummy=True))[2]
    )  # a dummy counts nothing
    assert logs[-1]["z_loss"].item() == 0.0
    with metrics.aggregate(new_root=True) as agg:
        out = CrossEntropyCriterion.reduce_metrics(logs)
    without = CrossEntropyCriterion.reduce_metrics([{k: v for k, v in log.items() if k != "z_loss"} for log in logs])
    assert out["z_loss"] == pytest.approx((logs[0]["z_loss"] + logs[1]["z_loss"]).item() / 12)
    assert agg.get_smoothed_values()["z_loss"] == pytest.approx(out["z_loss"], abs=1e-4)
    assert (out["loss"], out["ppl"]) == (without["loss"], without["ppl"])


def test_adaptive_loss_refuses_the_z_loss():
    with pytest.raises(UserError, match="--z-loss-coef"):
        criterion(1e-4, cls=AdaptiveLoss)
    assert criterion(0.0, cls=AdaptiveLoss).z_loss_coef == 0.0
