"""``toolkit-train --optimizer muon --qk-clip-threshold`` (Kimi K2's MuonClip) on 2 FSDP2 ranks against one
process taking both ranks' batches (``--update-freq 2``): each head's largest logit is reduced over the ranks
(all-reduce MAX) before the shards are rescaled, so both log the same losses and the same count of clipped heads;
the threshold is set low enough that heads are clipped at every update."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers import dist_helpers as H
from tests.helpers.dist_helpers import LOGGED_TOL

pytestmark = pytest.mark.integration

UPDATES = 3
REL_TOL = 1e-3
THRESHOLD = "0.05"  # below the tiny model's largest logits at initialization: the clip acts from the first update


def train(data_bin, save_dir, *flags):
    args = H.llama_args(str(save_dir))
    args[args.index("--optimizer") + 1] = "muon"
    args += ["--qk-clip-threshold", THRESHOLD, "--max-update", str(UPDATES), "--disable-validation", "--no-save"]
    proc = H.run_train([data_bin] + args + list(flags), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return H.losses(proc.stdout), clipped_heads(proc.stdout)


def clipped_heads(stdout: str) -> dict:
    """{update: heads clipped after it} from ``--log-format json`` lines."""
    out = {}
    for line in stdout.splitlines():
        m = re.search(r"\| train_inner \| (\{.*\})\s*$", line)
        if m:
            stats = json.loads(m.group(1))
            out[int(stats["num_updates"])] = float(stats["qk_clipped_heads"])
    return out


def test_two_fsdp_ranks_clip_as_one_process(tmp_path):
    data_bin = H.make_lm_data_bin(str(tmp_path / "bin"))
    want_losses, want_clipped = train(data_bin, tmp_path / "one", "--update-freq", "2")
    assert all(n > 0 for n in want_clipped.values()) and len(want_clipped) == UPDATES, want_clipped
    got_losses, got_clipped = train(
        data_bin, tmp_path / "fsdp", "--distributed-world-size", "2", "--ddp-backend", "fully_sharded"
    )
    assert got_clipped == want_clipped
    assert sorted(got_losses) == sorted(want_losses)
    for u in want_losses:
        assert abs(got_losses[u] - want_losses[u]) <= REL_TOL * abs(want_losses[u]) + LOGGED_TOL, u
