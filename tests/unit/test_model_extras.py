"""A model's auxiliary losses and metrics (``toolkit.models.outputs``) through the criterion and the trainer,
and the trainer's post-step hooks.

The toy auxiliary term is ``sum(w ** 2)`` of one weight matrix, so its gradient is known in closed form
(2w): an update's gradient with the term at coefficient c is the cross-entropy's plus exactly c * 2w.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import dist_helpers as H
from toolkit.criterions.cross_entropy import CrossEntropyCriterion
from toolkit.distributed.utils import DistributedEnv
from toolkit.logging import metrics
from toolkit.models.outputs import SUMMED_NLL, summed_nll_of, with_extras
from toolkit.train.resolve import parse_train_config
from toolkit.train.trainer import forward_and_loss

COEF = 0.5
WEIGHT = "layers.0.fc1.weight"


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("extras") / "bin"))


def build(data_bin, tmp_path, extras=None):
    """A trainer as toolkit-train builds it (2 micro-batches an update), its model returning ``extras(model)``."""
    from toolkit.train.train_loop import build_trainer, train_iterator

    cfg = parse_train_config([data_bin] + H.model_args(str(tmp_path)) + ["--update-freq", "2", "--clip-norm", "0"])
    trainer = build_trainer(cfg, DistributedEnv(), [cfg.dataset.train_subset, "valid"])
    if extras is not None:
        model, forward = trainer.model, trainer.model.forward

        def forward_with_extras(*a, **k):  # keeps what the model returned (its fused head's summed NLL, if any)
            out = forward(*a, **k)
            nll = summed_nll_of(out)
            own = {} if nll is None else {SUMMED_NLL: nll}
            return with_extras(CrossEntropyCriterion.logits_of(out), **own, **extras(model))

        model.forward = forward_with_extras
    itr = train_iterator(cfg, trainer, epoch=1).next_epoch_itr(shuffle=False)
    return trainer, [next(itr), next(itr)]


def aux_term(model):
    w = dict(model.named_parameters())[WEIGHT]
    return {"aux_losses": {"aux_loss": (w.pow(2).sum(), COEF)}, "metrics": {"router_entropy": 1.25}}


def step_gradients(trainer, samples):
    """The update's normalized gradients as the optimizer step receives them, and what was logged."""
    seen = {}
    step = trainer._step_optimizer

    def capture(grad_factor):
        seen.update(
            {
                n: p.grad.detach().clone() * grad_factor
                for n, p in trainer.model.named_parameters()
                if p.grad is not None
            }
        )
        return step(grad_factor)

    trainer._step_optimizer = capture
    with metrics.aggregate(new_root=True) as agg:
        trainer.train_step(samples)
    return seen, agg.get_smoothed_values()


def test_aux_loss_is_trained_with_its_coefficient_and_logged_and_valid_loss_is_the_cross_entropy(data_bin, tmp_path):
    with_aux, samples = build(data_bin, tmp_path / "a", aux_term)
    plain, _ = build(data_bin, tmp_path / "b")
    w = dict(with_aux.model.named_parameters())[WEIGHT].detach().clone()
    assert torch.equal(w, dict(plain.model.named_parameters())[WEIGHT])  # same seed, same start
    value = float(w.pow(2).sum())

    valid_sample = samples[0]
    v_aux, v_plain = with_aux.valid_step(valid_sample), plain.valid_step(valid_sample)
    assert v_aux["loss"] == v_plain["loss"]  # validation's loss (and so its ppl) is the cross-entropy alone
    assert v_aux["aux_loss"] == pytest.approx(value * v_aux["_sample_size"], rel=1e-6)

    grads_aux, logged_aux = step_gradients(with_aux, samples)
    grads_plain, logged_plain = step_gradients(plain, samples)
    assert logged_aux["aux_loss"] == pytest.approx(value, abs=1e-4)  # the value itself, whatever the micro-batches
    assert logged_aux["router_entropy"] == pytest.approx(1.25)
    assert logged_aux["loss"] == logged_plain["loss"] and "aux_loss" not in logged_plain
    assert grads_aux.keys() == grads_plain.keys()
    for name, g in grads_aux.items():
        extra = COEF * 2 * w if name == WEIGHT else torch.zeros_like(g)
        torch.testing.assert_close(g - grads_plain[name], extra, rtol=1e-4, atol=1e-6)


def test_reduce_metrics_weights_each_term_by_sample_size():
    logs = [
        {"loss": torch.tensor(8.0), "ntokens": 4, "nsentences": 1, "sample_size": 4, "z_loss": torch.tensor(4.0)},
        {"loss": torch.tensor(4.0), "ntokens": 2, "nsentences": 1, "sample_size": 2, "z_loss": torch.tensor(8.0)},
    ]
    with metrics.aggregate(new_root=True) as agg:
        out = CrossEntropyCriterion.reduce_metrics(logs)
    assert out["z_loss"] == pytest.approx(12.0 / 6) and agg.get_smoothed_values()["z_loss"] == pytest.approx(2.0)
    assert out["loss"] == pytest.approx(12.0 / 6 / math.log(2))


def test_an_aux_term_named_like_a_criterion_output_is_refused():
    logits = torch.zeros(1, 2, 3, requires_grad=True)
    with pytest.raises(ValueError, match="'ntokens'"):
        CrossEntropyCriterion.with_model_extras(
            with_extras(logits, {"ntokens": (logits.sum(), 1.0)}), logits.sum(), 2, {"loss": 0.0}
        )


class RouterBias(torch.nn.Module):
    """A module refreshing its state after each step (a MoE router's bias), found by the trainer."""

    def __init__(self, model):
        super().__init__()
        self.calls, self._model = [], [model]

    def after_optimizer_step(self) -> None:
        self.calls.append({k: v.detach().clone() for k, v in self._model[0].state_dict().items()})


def test_post_step_hooks_run_after_each_update_on_the_new_weights(data_bin, tmp_path):
    from toolkit.train.trainer import Trainer

    built, samples = build(data_bin, tmp_path)
    router = RouterBias(built.model)
    built.model.add_module("router", router)  # as a family would hold it: the trainer finds it by its method
    trainer = Trainer(built.cfg, built.task, built.model, built.criterion, built.env, built.strategy)
    order = []
    trainer.add_post_step_hook(lambda: order.append(len(router.calls)))  # after the module's hook (added first)
    start = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.train_step(samples)
    assert len(router.calls) == 1 and order == [1]
    after = trainer.model.state_dict()
    assert all(torch.equal(router.calls[0][k], after[k]) for k in after)
    assert not torch.equal(router.calls[0][WEIGHT], start[WEIGHT])
    trainer.train_step(samples)
    assert len(router.calls) == 2 and order == [1, 2]


def test_a_forward_that_drops_the_fused_loss_is_one_line():
    """A wrapper or override that returns neither logits nor the fused head's loss: a UserError naming the flag."""
    from types import SimpleNamespace

    from toolkit.core.errors import UserError

    class Dropping(torch.nn.Module):
        supports_fused_loss = True

        def forward(self, tokens, **kwargs):
            return with_extras(None)

    task = SimpleNamespace(target_dictionary=SimpleNamespace(pad=lambda: 1))
    sample = {
        "net_input": {"src_tokens": torch.tensor([[4, 5]])},
        "target": torch.tensor([[5, 6]]),
        "ntokens": 2,
        "nsentences": 1,
    }
    with pytest.raises(UserError, match=r"--head-loss-chunk-rows 512: the model's forward returned neither logits"):
        forward_and_loss(Dropping(), CrossEntropyCriterion(task), sample)
