"""Checks made before the first update, so that a run does not die at its first save.

Without them a ``--save-dir`` that is a file, a symlink loop or on a read-only filesystem
was found at the first checkpoint (every update before it lost), a ``--tensorboard-logdir``
that is a file at the first log line, and a token id past the dictionary (a cut
``dict.txt``, a damaged ``train.bin``) as an ``IndexError`` after hundreds of updates.
Each check costs a probe write or one max over a memory-mapped array.
"""

from __future__ import annotations

import errno
import os
import socket
from typing import TYPE_CHECKING, Optional

from toolkit.core.errors import UserError

if TYPE_CHECKING:  # numpy is not imported here: log setup and the commands' --help use this module
    import numpy as np


def describe_os_error(path: str, error: OSError) -> str:
    """What is wrong with ``path`` in words, from the error a mkdir or a write raised."""
    if os.path.islink(path) and not os.path.exists(path):
        return "is a symlink that leads nowhere (dangling, or a loop)"
    if error.errno == errno.ELOOP:
        return "goes through a symlink loop"
    if os.path.exists(path) and not os.path.isdir(path):
        return "is a file, not a folder"
    if error.errno == errno.EROFS:
        return "is on a read-only filesystem"
    if error.errno in (errno.EACCES, errno.EPERM):
        return "is not writable (permission denied)"
    if error.errno == errno.ENOSPC:
        return "is on a full disk"
    return f"cannot be written ({error.strerror or error})"


def check_writable_folder(flag: str, path: str) -> None:
    """``path`` exists as a folder (created if missing) and takes a file: a probe written and removed."""
    probe = os.path.join(path, f".write_probe.{socket.gethostname()}.{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        # created, never opened if something is there already (a symlink planted at the name is not followed)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise UserError(f"{flag} {path}: {describe_os_error(path, e)}; give a writable folder") from None


def check_writable_file(flag: str, path: str) -> None:
    """``path`` can be appended to (its folder created if missing); nothing is written to it."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UserError(f"{flag} {path}: is a folder, not a file; give a file name")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(path, "ab"):
            pass
    except OSError as e:
        if os.path.lexists(path):
            raise UserError(f"{flag} {path}: {describe_os_error(path, e)}; give a writable file") from None
        raise UserError(
            f"{flag} {path}: its folder {_nearest_existing(folder)} {describe_os_error(_nearest_existing(folder), e)}; "
            f"give a writable file"
        ) from None


def _nearest_existing(path: str) -> str:
    """``path`` or the closest of its parents that exists (what a failed makedirs tripped on)."""
    while path and not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def check_token_ids(prefix: str, tokens: np.ndarray, dictionary_size: int, dict_path: Optional[str]) -> None:
    """Every token id of a split is a row of the embedding: one max (and min) over the memory-mapped ids."""
    if len(tokens) == 0:
        return
    high, low = int(tokens.max()), int(tokens.min())
    if high < dictionary_size and low >= 0:
        return
    bad = high if high >= dictionary_size else low
    where = int((tokens == bad).argmax())
    raise UserError(
        f"{prefix}.bin: token id {bad} (at token {where:,}) is outside the dictionary's "
        f"{dictionary_size} entries ({dict_path or 'dict.txt'}); the dictionary is not the one this "
        f"split was binarized with, or the file is damaged: re-run toolkit-preprocess"
    )


def physical_memory() -> int:
    """Bytes of this machine's memory (0 where the system does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def check_fits_memory(what: str, parameters: int, parameter_bytes: int, shares: int, memory: int, fix: str) -> None:
    """A model whose parameters alone, split over ``shares`` ranks (the most any layout splits them), exceed
    ``memory`` bytes per rank is refused before anything is allocated: the allocator's own failure is a
    traceback about a size in bytes, after minutes of start-up (``--moe-num-experts 1000000000``)."""
    need = parameter_bytes / max(1, shares)
    if memory > 0 and need > memory:
        split = f"; {need / 2**30:,.1f} GiB on each of {shares} ranks" if shares > 1 else ""
        raise UserError(
            f"{what} has {parameters:,} parameters ({parameter_bytes / 2**30:,.1f} GiB{split}), more than the "
            f"{memory / 2**30:,.1f} GiB of memory {'each rank has' if shares > 1 else 'this machine has'}; {fix}"
        )
