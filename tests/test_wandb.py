"""--wandb-project: the scalars TensorBoard gets, read back from an offline W&B run's file."""
from __future__ import annotations

import glob
import json
import os
import struct
import time

import pytest

from toolkit.logging.meters import AverageMeter
from toolkit.logging.progress_bar import SimpleProgressBar, TensorboardProgressBarWrapper, close_tensorboard_writers

WANDB_HEADER = 7  # ":W&B", a 2-byte magic, a version byte
BLOCK = 32768  # then LevelDB's log format: 32 KiB blocks of (crc32, length, type) + payload records
RECORD_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_wandb_records(path: str):
    """The protobuf records of a ``run-*.wandb`` transaction log (wandb no longer ships a reader)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, pending = WANDB_HEADER, b""
    while pos + RECORD_HEADER <= len(data):
        if BLOCK - pos % BLOCK < RECORD_HEADER:  # block trailer too small for a header: padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if pos + RECORD_HEADER + length > len(data):  # still being written
            break
        chunk = data[pos + RECORD_HEADER:pos + RECORD_HEADER + length]
        pos += RECORD_HEADER + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def wait_for_exit_record(path: str, timeout: float = 30.0) -> str:
    """wandb's service process may still be writing the log when ``finish()`` returns."""
    deadline = time.time() + timeout
    while not any(r.WhichOneof("record_type") == "exit" for r in read_wandb_records(path)):
        assert time.time() < deadline, f"{path}: no exit record after {timeout}s"
        time.sleep(0.2)
    return path


def wandb_history(path: str):
    """{(name, step): value} from the run's history records."""
    out = {}
    for record in read_wandb_records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        step = items.pop("_step")
        out.update({(k, step): v for k, v in items.items() if not k.startswith("_")})
    return out


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
        bar.log({"loss": meter, "lr": 0.5 * step, "wps": step * 100, "num_updates": step, "flag": True,
                 "note": "text"}, tag="train_inner", step=step)
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


def test_toolkit_train_wandb_project_logs_the_run(tmp_path):
    pytest.importorskip("wandb")
    from tests.lm_fixtures import make_data_bin
    from tests.train_helpers import train

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
