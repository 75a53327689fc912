"""fp16 dynamic loss scaler: fairseq's semantics."""

import math

import pytest
import torch

from toolkit.optim.loss_scaler import DynamicLossScaler, default_scale_window, overflow_message

MIN_MSG = (
    "Minimum loss scale reached (0.5). Your loss is probably exploding. Try lowering the learning rate, "
    "using gradient clipping or increasing the batch size."
)


def test_defaults_and_scale():
    s = DynamicLossScaler()
    assert (s.loss_scale, s.scale_factor, s.scale_window, s.tolerance, s.threshold, s.min_loss_scale) == (
        128.0,
        2.0,
        2000,
        0.0,
        None,
        1e-4,
    )
    assert s.scale(torch.tensor(1.5)).item() == 192.0


def test_no_overflow_is_silent():
    s = DynamicLossScaler()
    s.check_overflow(3.5)
    s.check_overflow(torch.tensor(1e30).item())
    assert s.loss_scale == 128.0


@pytest.mark.parametrize("bad", [math.inf, math.nan, float("-inf")])
def test_overflow_halves_and_raises(bad):
    s = DynamicLossScaler(init_scale=128)
    with pytest.raises(OverflowError, match="setting loss scale to: 64.0"):
        s.check_overflow(bad)
    assert s.loss_scale == 64.0
    assert (
        overflow_message(s.loss_scale)
        == "NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: 64.0"
    )


def test_overflow_flag():
    s = DynamicLossScaler(init_scale=8)
    with pytest.raises(OverflowError):
        s.check_overflow(1.0, overflow=True)
    assert s.loss_scale == 4.0


def test_doubles_after_window_without_overflow():
    s = DynamicLossScaler(init_scale=4, scale_window=3)
    s.update()
    s.update()
    assert s.loss_scale == 4.0
    s.update()  # the 3rd clean update
    assert s.loss_scale == 8.0
    for _ in range(3):
        s.update()
    assert s.loss_scale == 16.0
    # an overflow restarts the window: 3 more clean updates before the next doubling
    with pytest.raises(OverflowError):
        s.check_overflow(math.inf)
    assert s.loss_scale == 8.0
    s.update()
    s.update()
    assert s.loss_scale == 8.0
    s.update()
    assert s.loss_scale == 16.0


def test_min_scale_raises_floating_point_error():
    s = DynamicLossScaler(init_scale=2, min_loss_scale=0.5)
    with pytest.raises(OverflowError):
        s.check_overflow(math.inf)  # 1.0
    with pytest.raises(FloatingPointError) as e:
        s.check_overflow(math.inf)  # would be 0.5 <= min
    assert str(e.value) == MIN_MSG
    assert s.loss_scale == 1.0  # left as it was


def test_threshold_floors_the_scale():
    # fairseq's --threshold-loss-scale: the scale is never lowered below it
    s = DynamicLossScaler(init_scale=64, threshold=32, min_loss_scale=1e-4)
    for _ in range(3):
        with pytest.raises(OverflowError, match="setting loss scale to: 32"):
            s.check_overflow(math.inf)
    assert s.loss_scale == 32.0


def test_tolerance_delays_the_decrease():
    s = DynamicLossScaler(init_scale=64, scale_window=1000, tolerance=0.25)
    for _ in range(10):
        s.update()
    # overflows since the last rescale / updates since it: 1/11, 2/12, 3/13 < 0.25 -> skipped, scale kept
    for _ in range(3):
        with pytest.raises(OverflowError, match="setting loss scale to: 64.0"):
            s.check_overflow(math.nan)
    with pytest.raises(OverflowError, match="setting loss scale to: 32.0"):
        s.check_overflow(math.nan)  # 4/14 >= 0.25


def test_state_dict_round_trip():
    s = DynamicLossScaler(init_scale=16, scale_window=4)
    s.update()
    with pytest.raises(OverflowError):
        s.check_overflow(math.inf)
    s.update()
    s2 = DynamicLossScaler(init_scale=1, scale_window=4)
    s2.load_state_dict(s.state_dict())
    for _ in range(5):
        s.update()
        s2.update()
        assert s2.loss_scale == s.loss_scale
    s3 = DynamicLossScaler()
    s3.load_state_dict({"loss_scale": 512.0})  # fairseq's checkpoints hold only the scale
    assert s3.loss_scale == 512.0


def test_default_scale_window():
    assert default_scale_window(1, 1) == 16384
    assert default_scale_window(8, 2) == 1024
    assert default_scale_window(3, 1) == 5461


def test_from_config():
    from toolkit.config import CommonConfig

    s = DynamicLossScaler.from_config(CommonConfig(fp16_init_scale=128), world_size=4, update_freq=2)
    assert (s.loss_scale, s.scale_window) == (128.0, 2048)
    s = DynamicLossScaler.from_config(CommonConfig(fp16_scale_window=100), world_size=4, update_freq=2)
    assert s.scale_window == 100
