"""A checkpoint that cannot be written (disk full, file too large) is one line, not a C++ traceback.

``torch.save`` reports a failed write as ``RuntimeError: [enforce fail at
inline_container.cc:672] . unexpected pos ...``; the ``OSError`` that says why is only in
the exception's context (when it wrote to a Python file object, as ``atomic_write`` and
DCP's writer do), or nowhere (when torch opened the file itself). This module finds the
errno in the exception chain, or else re-derives it from the filesystem (free space) and
the process's file-size limit, and says what still holds: the previous checkpoint,
which the atomic writes never touched.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
from typing import Iterator, Optional

import torch

from toolkit.checkpoint.dcp_state import dcp_failure

from toolkit.core.errors import UserError

WRITE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS, errno.EIO)
_TORCH_WRITE_FAILURE = ("inline_container", "unexpected pos", "iostream error", "PytorchStreamWriter failed")
LOW_SPACE_BYTES = 1 << 20


def _chain(error: BaseException) -> Iterator[BaseException]:
    """The error, its causes and contexts, and (DCP) every rank's wrapped failure."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]


def write_errno(error: BaseException, path: str) -> Optional[int]:
    """The errno behind a failed write of ``path``, or None when this is not a write failure."""
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
            return e.errno
    if not any(s in str(e) for e in _chain(error) for s in _TORCH_WRITE_FAILURE):
        return None
    try:  # torch hid the errno: ask the filesystem and the limits
        st = os.statvfs(os.path.dirname(os.path.abspath(path)) or ".")
        if st.f_bavail * st.f_frsize < LOW_SPACE_BYTES:
            return errno.ENOSPC
    except OSError:
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        return errno.EFBIG
    return errno.EIO


def last_checkpoint_update(save_dir: str) -> Optional[int]:
    """The update of ``checkpoint_last.pt`` (or the sharded ``checkpoint_last/``) in ``save_dir``, if readable."""
    for path in (os.path.join(save_dir, "checkpoint_last.pt"), os.path.join(save_dir, "checkpoint_last", "meta.pt")):
        if not os.path.isfile(path):
            continue
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            return int(state["extra_state"]["trainer"]["num_updates"])
        except Exception:
            continue
    return None


def previous_checkpoint(save_dir: str) -> str:
    update = last_checkpoint_update(save_dir)
    if update is None:
        return "no earlier checkpoint_last.pt was overwritten"
    return f"the previous checkpoint_last.pt (update {update}) is intact"


@contextlib.contextmanager
def reported(path: str, save_dir: str, remove: Optional[str] = None) -> Iterator[None]:
    """Turn a failed write of ``path`` into one UserError line; ``remove`` a temporary folder left behind."""
    try:
        yield
    except UserError:
        raise
    except BaseException as e:
        if not (isinstance(e, Exception) or dcp_failure(e)):
            raise
        code = write_errno(e, path)
        if code is None:
            raise
        if remove:
            shutil.rmtree(remove, ignore_errors=True)
        raise UserError(
            f"could not write {path}: {os.strerror(code)} (errno {code}); {previous_checkpoint(save_dir)}"
        ) from None
