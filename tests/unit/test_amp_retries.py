"""--amp-batch-retries (fairseq's trainer): an overflowing batch is retried with the lowered loss scale.

A GPU's fp16 overflow cannot be relied on here, so the overflow is injected into the real
loss scaler of a Trainer built as toolkit-train builds it (fp16 loss scaling on CPU): the
scaler sees the first K gradient norms as inf, lowers the scale each time, and raises as it
does on a real overflow. The reference is direct: K retries end in the update one clean step
at the lowered scale gives; more than N overflows skip the batch, leaving the weights as they were.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from tests.helpers import dist_helpers as H
from toolkit.train.amp_retries import AmpBatchRetries
from toolkit.distributed.utils import DistributedEnv
from toolkit.core.errors import UserError
from toolkit.train.resolve import parse_train_config

INIT_SCALE = 1024


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    return H.make_lm_data_bin(str(tmp_path_factory.mktemp("amp") / "bin"))


def build(data_bin, tmp_path, retries, amp=True):
    from toolkit.train.train_loop import build_trainer, train_iterator

    cfg = parse_train_config([data_bin] + H.model_args(str(tmp_path)) + ["--max-update", "1"])
    common = dataclasses.replace(
        cfg.common, fp16=True, amp=amp, amp_batch_retries=retries, fp16_init_scale=INIT_SCALE
    )  # --amp's path on a GPU, forced on CPU
    cfg = dataclasses.replace(cfg, common=common)
    trainer = build_trainer(cfg, DistributedEnv(), [cfg.dataset.train_subset])
    batch = next(iter(train_iterator(cfg, trainer, epoch=1).next_epoch_itr(shuffle=False)))
    return trainer, [batch]


def inject_overflows(trainer, count):
    """The next ``count`` overflow checks see an inf gradient norm; returns the list of forward passes run."""
    real_check, real_fb, forwards = trainer.scaler.check_overflow, trainer._forward_backward, []
    left = [count]

    def check(grad_norm=None, overflow=False):
        left[0] -= 1
        return real_check(float("inf") if left[0] >= 0 else grad_norm, overflow)

    def forward_backward(samples):
        forwards.append(trainer.scaler.loss_scale)
        return real_fb(samples)

    trainer.scaler.check_overflow, trainer._forward_backward = check, forward_backward
    return forwards


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("overflows", [1, 2])
def test_retries_train_the_batch_at_the_lowered_scale(data_bin, tmp_path, overflows):
    trainer, samples = build(data_bin, tmp_path, retries=2)
    start = weights(trainer)
    forwards = inject_overflows(trainer, overflows)
    assert trainer.train_step(samples) is not None
    assert trainer.num_updates == 1
    assert forwards == [INIT_SCALE / 2**i for i in range(overflows + 1)]  # each retry at the halved scale
    reference, _ = build(data_bin, tmp_path, retries=0)
    reference.model.load_state_dict(start)
    reference.scaler.loss_scale = INIT_SCALE / 2**overflows
    assert reference.train_step(samples) is not None
    for k, v in weights(reference).items():
        torch.testing.assert_close(weights(trainer)[k], v, rtol=0, atol=0)


def test_batch_skipped_once_the_retries_are_spent(data_bin, tmp_path, caplog):
    trainer, samples = build(data_bin, tmp_path, retries=2)
    start = weights(trainer)
    forwards = inject_overflows(trainer, 5)
    with caplog.at_level(logging.INFO, logger="toolkit.amp_retries"):
        assert trainer.train_step(samples) is None
    assert len(forwards) == 3 and trainer.num_updates == 0  # the batch and its 2 retries
    assert sum("AMP: skipping this batch." in r.getMessage() for r in caplog.records) == 1
    assert all(torch.equal(v, start[k]) for k, v in weights(trainer).items())
    # the next batch gets its own retries (2 overflows left: retried twice, then trained)
    assert trainer.train_step(samples) is not None and len(forwards) == 6 and trainer.num_updates == 1


def test_plain_fp16_skips_without_retrying(data_bin, tmp_path):
    trainer, samples = build(data_bin, tmp_path, retries=2, amp=False)
    forwards = inject_overflows(trainer, 1)
    assert trainer.train_step(samples) is None and len(forwards) == 1  # fairseq: only --amp retries


def test_retry_counter_unit():
    calls = []
    retries = AmpBatchRetries(1)
    assert retries.after_overflow(lambda: calls.append(1) or "done") == "done" and retries.used == 0
    assert retries.after_overflow(lambda: retries.after_overflow(lambda: "never")) is None
    assert AmpBatchRetries(0).after_overflow(lambda: "never") is None


def test_flag_validated_and_no_effect_said_once(caplog):
    with pytest.raises(UserError, match="--amp-batch-retries must be >= 0"):
        parse_train_config(["data-bin", "--max-update", "1", "--amp-batch-retries", "-1"])
    with caplog.at_level(logging.INFO, logger="toolkit.resolve"):
        cfg = parse_train_config(["data-bin", "--max-update", "1", "--cpu", "--amp", "--amp-batch-retries", "3"])
    assert cfg.common.amp_batch_retries == 3
    lines = [r.getMessage() for r in caplog.records if "--amp-batch-retries 3" in r.getMessage()]
    assert len(lines) == 1 and "no effect" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="toolkit.resolve"):
        parse_train_config(["data-bin", "--max-update", "1", "--cpu", "--amp"])
    assert not any("--amp-batch-retries" in r.getMessage() for r in caplog.records)
