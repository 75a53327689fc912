"""Writes that never leave a half-written file behind."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", **open_kwargs) -> Iterator:
    """Write to a temporary file beside ``path``; rename over it only when the block succeeds."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        with open(tmp, mode, **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_directory(path: str) -> Iterator[str]:
    """Yield a temporary folder beside ``path``; it becomes ``path`` only when the block succeeds."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(os.path.abspath(path)) + ".", suffix=".tmp", dir=parent)
    try:
        yield tmp
        if os.path.isdir(path):
            old = tmp + ".old"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
