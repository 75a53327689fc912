"""Memory options: activation checkpointing / offloading change no gradient; --cpu-offload with
DeepSpeed CPU Adam, fp16 and activation checkpointing trains on 2 CPU processes and resumes;
benchmarks/memory.py measures that checkpointing shrinks the saved activations."""

from __future__ import annotations

import os
import random
import re

import pytest
import torch

from tests.helpers.lm_fixtures import make_data_bin
from tests.helpers.cli import train

WORDS = [f"w{i}" for i in range(100)]


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    rng = random.Random(0)
    lines = lambda n: [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 25))) for _ in range(n)]  # noqa
    dest = tmp_path_factory.mktemp("mem-bin")
    make_data_bin(str(dest), {"train": lines(300), "valid": lines(30)})
    return str(dest)


OFFLOAD_COMMAND = [
    "--ddp-backend",
    "fully_sharded",
    "--cpu-offload",
    "--optimizer",
    "cpu_adam",
    "--fp16",
    "--checkpoint-activations",
    "--distributed-world-size",
    "2",
]


@pytest.mark.parametrize("checkpoint_format", ["consolidated", "sharded"])
def test_cpu_offload_cpu_adam_fp16_checkpointing_two_processes_trains_and_resumes(
    data_bin, tmp_path, checkpoint_format
):
    command = OFFLOAD_COMMAND + (["--use-sharded-state"] if checkpoint_format == "sharded" else [])
    first = train(
        data_bin, str(tmp_path / "a"), *command, "--max-update", "6", "--save-interval-updates", "3", timeout=600
    )
    assert "spawning 2 workers" in first.stdout
    losses = first.losses()
    assert sorted(losses) == list(range(1, 7)) and losses[6] < losses[1], losses
    inner = first.records("train_inner")
    assert all(r["loss_scale"] == "128" for r in inner) and inner[0]["wpb"] == "256"  # 2 ranks x 4 x 32 tokens

    saved = str(tmp_path / "a" / "checkpoint_1_3")
    if checkpoint_format == "consolidated":
        saved += ".pt"
        state = torch.load(saved, map_location="cpu", weights_only=True)
        assert state["optimizer_name"] == "cpu_adam"
        embed = state["model"]["embed_tokens.weight"]
        opt_state = state["last_optimizer_state"]["state"]["embed_tokens.weight"]
        assert embed.dtype == torch.float32  # fp32 master weights, consolidated from both ranks' shards
        assert opt_state["exp_avg"].shape == embed.shape and opt_state["exp_avg"].dtype == torch.float32
        assert float(opt_state["step"]) == 3
        assert state["extra_state"]["trainer"]["loss_scaler"]["loss_scale"] == 128.0
    else:
        assert os.path.isdir(saved) and any(f.endswith(".distcp") for f in os.listdir(saved))

    # Resume the update-3 checkpoint, this time also offloading the saved activations: same losses.
    resumed = train(
        data_bin,
        str(tmp_path / "b"),
        *command,
        "--offload-activations",
        "--restore-file",
        saved,
        "--max-update",
        "6",
        timeout=600,
    )
    assert re.search(r"loaded (sharded )?checkpoint .*checkpoint_1_3", resumed.stdout)
    assert sorted(resumed.losses()) == [4, 5, 6]
    for update in (4, 5, 6):
        assert resumed.losses()[update] == pytest.approx(losses[update], rel=1e-6), update


def test_cpu_offload_refuses_an_explicit_other_optimizer(data_bin, tmp_path):
    run = train(
        data_bin,
        str(tmp_path),
        "--ddp-backend",
        "fully_sharded",
        "--cpu-offload",
        "--fp16",
        "--max-update",
        "1",
        check=False,
    )  # TINY_MODEL says --optimizer adam
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == (
        "toolkit-train: error: --cpu-offload requires --optimizer cpu_adam or muon (the offloaded shards are updated "
        "in host memory by DeepSpeed's CPU Adam or Muon's host-memory momentum), got --optimizer adam; drop "
        "--optimizer or use --optimizer cpu_adam"
    )
    assert not os.listdir(tmp_path)  # refused before anything was written
