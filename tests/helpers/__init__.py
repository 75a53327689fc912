"""What the tests share, in one place: the repository root, the corpora beside it and a free port.

Tests import helpers only from this package (and fixtures from conftest), never from another test
module: a test file can then move between tiers, or be deleted, without breaking the others.
"""

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED_DATA = os.path.abspath(os.path.join(REPO_ROOT, "..", "shared", "data"))


def free_port() -> int:
    """A port free now on 127.0.0.1, for a rendezvous the test starts itself (the toolkit's own finder)."""
    from toolkit.distributed.utils import find_free_port

    return find_free_port()
