"""A worker never outlives its launcher: kill -9 the launcher, and every worker is gone within 10 s."""

from __future__ import annotations

import os
import sys

import pytest

from toolkit.distributed import parent_watch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_orphan_check_in_this_process():
    assert parent_watch.set_parent_death_signal(0)  # 0 clears it: the call itself works here
    watch = parent_watch.ParentWatch(os.getppid(), "x", "y")
    assert not watch.orphaned()
    assert parent_watch.ParentWatch(os.getppid() + 1, "x", "y").orphaned()
