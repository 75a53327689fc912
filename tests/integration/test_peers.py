"""``benchmarks.peers --quick``: every row runs or is one skipped row naming its install; the table is written.

The fairseq rows are pointed at an empty FAIRSEQ home, so this checks the skipped-row path in seconds (the
fairseq commands themselves run in benchmarks/fairseq_parity/parity.py); the transformers rows run for real on
tiny shapes. Speed is not asserted: only that both sides ran, were timed, and computed the same loss.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT
from tests.helpers.cli import subprocess_env

pytest.importorskip("transformers")


def test_quick_table(tmp_path):
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.peers",
            "--quick",
            "--warmup",
            "0",
            "--fairseq-home",
            str(tmp_path / "no-fairseq"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    for name in ("training step, Llama", "training step, Qwen3-MoE", "training step, GPT-2"):
        row = rows[next(n for n in rows if n.startswith(name))]
        assert row["toolkit"]["median_s"] > 0 and row["peer_timing"]["median_s"] > 0
        assert row["last_loss_diff"] < 1e-3, row  # the same model and batch on both sides
    generation = rows[next(n for n in rows if n.startswith("cached greedy generation"))]
    assert generation["toolkit"]["rate"] > 0 and generation["peer_timing"]["rate"] > 0
    skipped = [r for r in result["rows"] if "skipped" in r]
    assert len(skipped) == 3 and all("fairseq_parity/setup.sh" in r["skipped"] for r in skipped)
    assert "| training step, Llama" in proc.stdout and "skipped: bash benchmarks/fairseq_parity/setup.sh" in proc.stdout
    assert "load average" in result["markdown"]
