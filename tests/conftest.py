import os

import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.path.abspath(os.path.join(REPO_ROOT, "..", "shared", "data"))

# Two cores here and on CI: extra intra-op threads only add contention between test processes.
torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_configure(config):
    config.addinivalue_line("markers", "faults: kill -9 fault suite (starts ~10 training processes)")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one; `pytest -m gpu` on a GPU machine)")


@pytest.fixture(scope="session")
def shared_data() -> str:
    """The real corpora beside the repo (../shared/data); tests that need them skip without them."""
    if not os.path.isdir(SHARED_DATA):
        pytest.skip(f"shared corpora not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def wikitext_dir(shared_data) -> str:
    return os.path.join(shared_data, "wikitext-2-mini")


@pytest.fixture(scope="session")
def shakespeare_file(shared_data) -> str:
    return os.path.join(shared_data, "tinyshakespeare", "input.txt")
