"""Writes that never leave a half-written file behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator


def process_umask() -> int:
    """This process's umask, read without changing it (``os.umask`` can only set it, racing other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _as_if_created(path: str, directory: bool = False) -> None:
    """mkstemp/mkdtemp create 0600/0700 whatever the umask: give the usual open()/mkdir() mode instead."""
    os.chmod(path, (0o777 if directory else 0o666) & ~process_umask())


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", **open_kwargs) -> Iterator:
    """Write to a temporary file beside ``path``; rename over it only when the block succeeds."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # mkstemp creates the file itself (O_EXCL | O_NOFOLLOW) and the block writes through that descriptor:
    # the temporary name is never opened again, so nothing put there meanwhile (a symlink) is followed.
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, 0o666 & ~process_umask())
        with os.fdopen(fd, mode, **open_kwargs) as f:
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
    _as_if_created(tmp, directory=True)
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
