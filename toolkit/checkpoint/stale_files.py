"""Temporary files of saves that crashed (``kill -9``, a lost node) are removed when a run starts.

Only names our own writers produce are touched:

- ``atomic_write``: ``.NAME.XXXXXXXX.tmp`` files (``tempfile.mkstemp``'s 8 random characters);
- sharded saves: ``.checkpoint_X.PID-RANDOM.tmp`` / ``.checkpoint_X.PID-RANDOM.old`` folders (and the
  older ``.checkpoint_X.tmp`` / ``.checkpoint_X.old``), and only when the
  complete ``checkpoint_X`` folder exists (otherwise one of them *is* the checkpoint, after
  a crash between two renames, and :func:`toolkit.checkpoint.sharded.find_sharded` loads it);
- consolidation's former scratch file ``.NAME.pt.dcp.tmp``.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from typing import List

logger = logging.getLogger(__name__)

ATOMIC_WRITE_TMP = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")
SHARDED_TMP = re.compile(r"\.(checkpoint[^/]*?)(?:\.\d+-[0-9a-f]{8})?\.(tmp|old)")
DCP_SCRATCH = re.compile(r"\..+\.pt\.dcp\.tmp")


def stale_temp_paths(save_dir: str) -> List[str]:
    """Our temporary files and folders in ``save_dir`` that no running save can be using."""
    if not os.path.isdir(save_dir):
        return []
    found = []
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        sharded = SHARDED_TMP.fullmatch(name)
        if sharded and os.path.isdir(path):
            from toolkit.checkpoint.sharded import is_complete

            if is_complete(os.path.join(save_dir, sharded.group(1))):
                found.append(path)
        elif ATOMIC_WRITE_TMP.fullmatch(name) or DCP_SCRATCH.fullmatch(name):
            found.append(path)
    return found


def _size(path: str) -> int:
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def remove_stale_temp_files(save_dir: str) -> List[str]:
    """Remove them (one INFO line); call on one rank, before anything is saved. Returns what was removed."""
    paths = stale_temp_paths(save_dir)
    if not paths:
        return []
    total = 0
    for path in paths:
        try:
            total += _size(path)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass
    logger.info(
        f"removed {len(paths)} temporary file(s) left by interrupted saves in {save_dir} "
        f"({total / 2**20:.1f} MiB): {', '.join(os.path.basename(p) for p in paths)}"
    )
    return paths
