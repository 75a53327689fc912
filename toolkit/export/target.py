"""Where an export may write: never over files it did not write (``toolkit-export --out``).

An export is written into a temporary folder beside ``--out`` and renamed into place
(:func:`toolkit.core.fileio.atomic_directory`). Before that, the target is checked:

- a missing or empty folder is fine;
- a non-empty one is refused, unless ``--force`` is given *and* it is an earlier export:
  it holds :data:`MANIFEST` (written by every export, listing its files) and nothing else
  besides the files listed there. A ``notes.txt`` put beside an export keeps it;
- the input's own folder (``--path s/checkpoint_last.pt --out s``), a folder that holds the
  input, and the current folder (or one above it) are refused even with ``--force``.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator, List, Optional

from toolkit.core.errors import UserError
from toolkit.core.fileio import atomic_directory

MANIFEST = "toolkit_export.json"
MANIFEST_FORMAT = "toolkit-export-v1"


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def _files_under(folder: str) -> List[str]:
    found = []
    for root, _, files in os.walk(folder):
        found += [os.path.relpath(os.path.join(root, name), folder) for name in files]
    return sorted(found)


def listed_files(folder: str) -> Optional[List[str]]:
    """The files an earlier export's manifest lists (None: no readable manifest, so not our export)."""
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None
    files = manifest.get("files")
    return [str(name) for name in files] if isinstance(files, list) else None


def check_target(out: str, input_path: str, force: bool) -> None:
    """One UserError when writing ``out`` could delete or mix with anything the export did not write."""
    flag = f"--out {out}"
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"{flag}: exists and is not a folder; give a new folder name")
    if _inside(os.getcwd(), out):
        raise UserError(f"{flag}: is the current folder (or holds it); give a new folder name, e.g. {flag}/export")
    if _inside(input_path, out):
        raise UserError(
            f"{flag}: holds the input --path {input_path}, which replacing it would delete; choose another --out"
        )
    if not os.path.isdir(out) or not os.listdir(out):
        return
    if not force:
        raise UserError(
            f"{flag}: folder exists and is not empty; choose a new folder, or pass --force to "
            f"replace an earlier export (one with {MANIFEST})"
        )
    listed = listed_files(out)
    if listed is None:
        raise UserError(
            f"{flag}: not an earlier export (no {MANIFEST}), so --force does not replace it; choose a new folder"
        )
    foreign = [name for name in _files_under(out) if name != MANIFEST and name not in listed]
    if foreign:
        raise UserError(
            f"{flag}: holds files the export did not write ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}); move them out or choose a new folder"
        )


@contextlib.contextmanager
def export_directory(out: str) -> Iterator[str]:
    """A temporary folder that becomes ``out`` (with its manifest) when the block succeeds."""
    with atomic_directory(out) as tmp:
        yield tmp
        manifest = {"format": MANIFEST_FORMAT, "tool": "toolkit-export", "files": _files_under(tmp)}
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
