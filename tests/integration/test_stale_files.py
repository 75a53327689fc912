"""Leftovers of crashed saves are removed at start; checkpoints get the process umask's mode."""

from __future__ import annotations

import os
import stat

from tests.helpers import dist_helpers as H


def test_training_removes_leftovers_and_writes_with_the_umask(tmp_path):
    data_bin = H.make_lm_data_bin(str(tmp_path / "bin"))
    save = tmp_path / "save"
    os.makedirs(save)
    (save / ".checkpoint_last.pt.abcd1234.tmp").write_bytes(b"\0" * 4096)
    proc = H.run_cli(
        "toolkit_cli.train",
        [data_bin, *H.model_args(str(save)), "--max-update", "2", "--disable-validation"],
        timeout=240,
        limits={"umask": 0o002},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    removed = [line for line in proc.stdout.splitlines() if "left by interrupted saves" in line]
    assert len(removed) == 1 and "| INFO |" in removed[0] and ".checkpoint_last.pt.abcd1234.tmp" in removed[0]
    assert sorted(os.listdir(save)) == ["checkpoint_last.pt"]
    assert stat.S_IMODE(os.stat(save / "checkpoint_last.pt").st_mode) == 0o664
