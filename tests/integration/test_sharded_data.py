"""Epoch-sharded data (``DATA=shard0:shard1:...``): epoch e trains on shard (e-1) mod n, as fairseq."""

from __future__ import annotations

import re

from tests.helpers.cli import TINY_MODEL, run_cli
from tests.helpers.sharded import make_shards


def test_training_rotates_shards(tmp_path):
    paths = make_shards(str(tmp_path), n=2)
    run = run_cli(
        "toolkit_cli.train",
        [":".join(paths), *TINY_MODEL, "--max-epoch", "3", "--save-dir", str(tmp_path / "ckpt"), "--no-save"],
    )
    assert run.returncode == 0, run.stderr
    loads = re.findall(r"(shard\d) train \d+ examples", run.stdout)
    assert loads[:3] == ["shard0", "shard1", "shard0"]
