"""--wandb-project: the scalars TensorBoard gets, read back from an offline W&B run's file."""

from __future__ import annotations

import glob

import pytest
from tests.helpers.wandb_records import wait_for_exit_record, wandb_history


def test_toolkit_train_wandb_project_logs_the_run(tmp_path):
    pytest.importorskip("wandb")
    from tests.helpers.lm_fixtures import make_data_bin
    from tests.helpers.cli import train

    lines = [" ".join(f"w{(i * 3 + j) % 20}" for j in range(10)) for i in range(100)]
    data = str(tmp_path / "bin")
    make_data_bin(data, {"train": lines, "valid": lines[:10]})
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    train(data, str(tmp_path / "ck"), "--max-update", "3", "--wandb-project", "toolkit-test", env=env)
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    got = wandb_history(wait_for_exit_record(runs[0]))
    assert {step for key, step in got if key == "train_inner/loss"} == {1, 2, 3}
    assert any(key == "valid/loss" for key, _ in got)
