"""Forged checkpoints never run code: every entry point refuses them with one line.

Each forgery holds a pickle whose ``__reduce__`` would run ``touch MARKER``; after each
command the marker must not exist, the exit status is non-zero and stderr is one
``prog: error: ...`` line without a traceback.
"""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from tests.helpers.checkpoints import Payload
from toolkit.checkpoint import safe_pickle
from toolkit.core.errors import UserError


def test_restricted_load_allows_only_the_allowlist(tmp_path):
    data = pickle.dumps({"a": [1, 2.0, (3, "x")], "size": torch.Size([2, 3])})
    allowed = {("torch", "Size"): torch.Size}
    assert safe_pickle.restricted_load(io.BytesIO(data), allowed, "x") == pickle.loads(data)
    marker = tmp_path / "MARKER"
    with pytest.raises(UserError, match=r"^f\.pkl: refusing to load: unexpected object (posix|os)\.system$"):
        safe_pickle.restricted_load(io.BytesIO(pickle.dumps(Payload(str(marker)))), allowed, "f.pkl")
    assert not marker.exists()
