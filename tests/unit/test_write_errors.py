"""A save that hits a full disk or the file-size limit is one line, and leaves the last checkpoint intact.

The limit is the process's ``RLIMIT_FSIZE`` (``ulimit -f``), set in the child only, with
SIGXFSZ ignored so that the write fails with EFBIG instead of killing it: no root needed.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

from toolkit.checkpoint import write_errors
from toolkit.core.errors import UserError


def test_errno_hidden_by_torch_is_recovered(tmp_path, monkeypatch):
    wrapped = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise wrapped
    except RuntimeError as e:
        assert write_errors.write_errno(e, str(tmp_path / "x.pt")) == errno.ENOSPC
    bare = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    full = os.statvfs_result((4096, 4096, 100, 0, 0, 10, 0, 0, 0, 255))
    monkeypatch.setattr(os, "statvfs", lambda _p: full)
    assert write_errors.write_errno(bare, str(tmp_path / "x.pt")) == errno.ENOSPC
    assert write_errors.write_errno(ValueError("something else"), str(tmp_path / "x.pt")) is None


def test_reported_names_the_previous_checkpoint(tmp_path):
    torch.save({"extra_state": {"trainer": {"num_updates": 7}}}, tmp_path / "checkpoint_last.pt")
    with pytest.raises(UserError) as info:
        with write_errors.reported(str(tmp_path / "checkpoint_last.pt"), str(tmp_path)):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert str(info.value) == (
        f"could not write {tmp_path / 'checkpoint_last.pt'}: No space left on device "
        f"(errno 28); the previous checkpoint_last.pt (update 7) is intact"
    )
    with pytest.raises(ZeroDivisionError):  # not a write failure: left alone
        with write_errors.reported(str(tmp_path / "x"), str(tmp_path)):
            1 / 0
