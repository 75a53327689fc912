"""Restarting a finished run changes nothing; raising --max-update continues it exactly."""

from __future__ import annotations

from toolkit.checkpoint.resume import StopCriteria, finished_reason


def test_finished_reason_checks_each_criterion():
    name = "checkpoint_last.pt"
    assert finished_reason(name, StopCriteria(max_update=5), 5, 1, 1e-3) == (
        "| done: checkpoint_last.pt is at update 5 >= --max-update 5; nothing to do"
    )
    assert finished_reason(name, StopCriteria(max_update=6), 5, 1, 1e-3) is None
    assert "finished epoch 2 >= --max-epoch 2" in finished_reason(name, StopCriteria(max_epoch=2), 9, 3, 1e-3)
    assert finished_reason(name, StopCriteria(max_epoch=2), 9, 2, 1e-3) is None
    assert "--stop-min-lr 0.001" in finished_reason(name, StopCriteria(stop_min_lr=1e-3), 9, 1, 1e-3)
    assert finished_reason(name, StopCriteria(stop_min_lr=1e-4), 9, 1, 1e-3) is None
    assert "--stop-time-hours" in finished_reason(name, StopCriteria(stop_time_hours=1.0), 9, 1, 1e-3, 1.5)
    assert finished_reason(name, StopCriteria(), 10**6, 99, 0.0) is None
