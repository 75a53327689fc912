"""--wandb-project: the scalars TensorBoard gets, read back from an offline W&B run's file."""

from __future__ import annotations

import glob
import os

import pytest

from tests.helpers.wandb_records import wait_for_exit_record, wandb_history
from toolkit.logging.meters import AverageMeter
from toolkit.logging.progress_bar import SimpleProgressBar, TensorboardProgressBarWrapper, close_tensorboard_writers


def tensorboard_scalars(logdir: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = {}
    for tag_dir in os.listdir(logdir):
        acc = EventAccumulator(os.path.join(logdir, tag_dir))
        acc.Reload()
        for name in acc.Tags()["scalars"]:
            out.update({(f"{tag_dir}/{name}", e.step): e.value for e in acc.Scalars(name)})
    return out


def test_wandb_logs_the_tensorboard_scalars(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from toolkit.logging import wandb_writer as logging_wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    meter = AverageMeter()
    bar = SimpleProgressBar(range(3), epoch=1, log_interval=1)
    bar = TensorboardProgressBarWrapper(bar, str(tmp_path / "tb"))
    bar = logging_wandb.wrap_with_wandb(bar, "toolkit-test", "run")
    for step in (1, 2, 3):
        meter.update(4.0 / step)
        bar.log(
            {"loss": meter, "lr": 0.5 * step, "wps": step * 100, "num_updates": step, "flag": True, "note": "text"},
            tag="train_inner",
            step=step,
        )
    bar.print({"loss": 1.25, "ppl": 2.5, "num_updates": 3}, tag="valid", step=3)
    close_tensorboard_writers()
    logging_wandb.finish()
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    got = wandb_history(wait_for_exit_record(runs[0]))
    expected = tensorboard_scalars(str(tmp_path / "tb"))
    assert set(got) == set(expected) and len(expected) == 3 * 3 + 2
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6)  # TensorBoard stores float32


def test_without_a_project_the_bar_is_unchanged():
    from toolkit.logging import wandb_writer as logging_wandb

    bar = SimpleProgressBar(range(1))
    assert logging_wandb.wrap_with_wandb(bar, None) is bar
