"""Checkpoints carry checksums of their tensors, checked before anything is loaded.

- A consolidated ``.pt`` is a zip archive (``torch.save``) in which every record (each
  tensor's storage, the pickle) has its CRC-32 stored beside it. :func:`check_file` reads
  every record and compares (``zipfile.testzip``) before ``torch.load``, which does not.
- A sharded (DCP) folder gets :data:`CHECKSUMS`, the CRC-32 and size of every file in it,
  written by rank 0 once all shards are on disk; :func:`check_folder` recomputes them.
  Folders saved before this have no such file and are loaded as before.

A mismatch is one line naming the damaged file and the newest intact checkpoint beside it
(if any), so a resume can be pointed at it. The cost is one extra read of the checkpoint at
load (about a quarter of ``torch.load``'s own time) and, for sharded saves, one at save.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
import zlib
from typing import Dict, List, Optional

from toolkit.core.errors import UserError

CHECKSUMS = "checksums.json"
CHECKPOINT_NAME = re.compile(r"checkpoint.*")
CHUNK = 16 << 20


def file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def damaged_record(path: str) -> Optional[str]:
    """The first record of the zip ``path`` whose data does not match its stored CRC (None: all match,
    or not a zip archive, which ``torch.load`` then judges)."""
    if not zipfile.is_zipfile(path):
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
        return None if bad is None else f"record {bad}"
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return f"its zip structure ({e})"


def folder_checksums(folder: str) -> Dict[str, Dict[str, int]]:
    """``{file name: {"crc32": ..., "size": ...}}`` for every file directly in ``folder``."""
    sums = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name != CHECKSUMS and os.path.isfile(path):
            sums[name] = {"crc32": file_crc32(path), "size": os.path.getsize(path)}
    return sums


def write_folder_checksums(folder: str) -> None:
    """Record the checksums of a complete sharded checkpoint's files (before it is published)."""
    from toolkit.core.fileio import atomic_write

    sums = folder_checksums(folder)  # before the record's own temporary file appears there
    with atomic_write(os.path.join(folder, CHECKSUMS), "w", encoding="utf-8") as f:
        json.dump({"format": "crc32", "files": sums}, f, indent=1, sort_keys=True)


def damaged_shard(folder: str) -> Optional[str]:
    """The first file of a sharded checkpoint that differs from its recorded checksum (None: all match, or
    nothing recorded)."""
    try:
        with open(os.path.join(folder, CHECKSUMS), encoding="utf-8") as f:
            recorded = json.load(f)["files"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return CHECKSUMS
    for name, expected in sorted(recorded.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or os.path.getsize(path) != expected.get("size"):
            return name
        if file_crc32(path) != expected.get("crc32"):
            return name
    return None


def _is_intact(path: str) -> bool:
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, ".metadata")) and damaged_shard(path) is None
    return zipfile.is_zipfile(path) and damaged_record(path) is None


def newest_intact_beside(path: str) -> Optional[str]:
    """The most recently written other checkpoint (file or sharded folder) in ``path``'s folder that is intact."""
    folder = os.path.dirname(os.path.abspath(path))
    candidates: List[str] = []
    for name in os.listdir(folder):
        other = os.path.join(folder, name)
        if CHECKPOINT_NAME.fullmatch(name) and os.path.abspath(other) != os.path.abspath(path):
            candidates.append(other)
    for other in sorted(candidates, key=os.path.getmtime, reverse=True):
        if _is_intact(other):
            return other
    return None


def _refusal(path: str, what: str) -> UserError:
    intact = newest_intact_beside(path)
    hint = (
        f"the newest intact checkpoint beside it is {intact} (give it to --restore-file or --path)"
        if intact
        else "no intact checkpoint beside it; restore the file from a copy"
    )
    return UserError(
        f"{path}: damaged: {what} does not match the checksum stored at save (changed or corrupted "
        f"on disk since); {hint}"
    )


def check_file(path: str) -> None:
    """A consolidated checkpoint whose stored CRCs do not all match: one UserError."""
    what = damaged_record(path)
    if what is not None:
        raise _refusal(path, what)


def check_folder(folder: str) -> None:
    """A sharded checkpoint with a file that differs from its recorded checksum: one UserError."""
    name = damaged_shard(folder)
    if name is not None:
        raise _refusal(folder, f"shard file {name}")
