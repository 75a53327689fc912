"""One typed configuration: parsed once, implied settings resolved (and logged), validated before any worker."""

import os

from tests.helpers.lm_fixtures import make_data_bin
from tests.helpers.cli import run_cli


def test_headline_command_runs_as_typed_on_cpu(tmp_path):
    words = [f"w{i}" for i in range(40)]
    lines = [" ".join(words[(i * 7 + j) % 40] for j in range(12)) for i in range(200)]
    data = str(tmp_path / "bin")
    make_data_bin(data, {"train": lines, "valid": lines[:20]})
    run = run_cli(
        "toolkit_cli.train",
        [
            data,
            "--ddp-backend",
            "fully_sharded",
            "--cpu-offload",
            "--max-update",
            "3",
            "--save-dir",
            str(tmp_path / "ck"),
            "--decoder-layers",
            "1",
            "--decoder-embed-dim",
            "32",
            "--decoder-ffn-embed-dim",
            "64",
            "--tokens-per-sample",
            "32",
        ],
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--cpu-offload: using --optimizer cpu_adam" in run.stdout
    assert "Stopping training due to num_updates: 3 >= max_update: 3" in run.stdout
    assert os.path.exists(tmp_path / "ck" / "checkpoint_last.pt")
