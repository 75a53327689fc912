"""Leftovers of crashed saves are removed at start; checkpoints get the process umask's mode."""

from __future__ import annotations

import os
import stat

from toolkit.checkpoint.stale_files import remove_stale_temp_files, stale_temp_paths
from toolkit.core.fileio import atomic_directory, atomic_write, process_umask


def complete_sharded(folder):
    os.makedirs(folder)
    for name in (".metadata", "meta.pt"):
        open(os.path.join(folder, name), "wb").close()


def test_only_our_stale_temp_names_are_removed(tmp_path):
    keep = ["checkpoint_last.pt", "notes.txt", ".hidden", "checkpoint_1_5.pt.tmp", ".x.short.tmp"]
    for name in keep:
        (tmp_path / name).write_text("x")
    (tmp_path / ".checkpoint_last.pt.k2j_9x0a.tmp").write_bytes(b"half")
    (tmp_path / ".checkpoint_best.pt.dcp.tmp").write_bytes(b"scratch")
    complete_sharded(str(tmp_path / "checkpoint_last"))
    os.makedirs(tmp_path / ".checkpoint_last.tmp")  # stale: checkpoint_last/ is complete
    os.makedirs(tmp_path / ".checkpoint_last.old")
    os.makedirs(tmp_path / ".checkpoint_1_10.tmp")  # checkpoint_1_10/ missing: may be the only copy
    expected = sorted(
        str(tmp_path / n)
        for n in (
            ".checkpoint_best.pt.dcp.tmp",
            ".checkpoint_last.old",
            ".checkpoint_last.pt.k2j_9x0a.tmp",
            ".checkpoint_last.tmp",
        )
    )
    assert stale_temp_paths(str(tmp_path)) == expected
    assert remove_stale_temp_files(str(tmp_path)) == expected
    assert sorted(os.listdir(tmp_path)) == sorted(keep + ["checkpoint_last", ".checkpoint_1_10.tmp"])
    assert remove_stale_temp_files(str(tmp_path / "missing")) == []


def test_atomic_writes_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        assert process_umask() == 0o027
        with atomic_write(str(tmp_path / "f"), "w") as f:
            f.write("x")
        with atomic_directory(str(tmp_path / "d")):
            pass
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "f").st_mode) == 0o640
    assert stat.S_IMODE(os.stat(tmp_path / "d").st_mode) == 0o750
