import os

import pytest
import torch

from tests.helpers import SHARED_DATA
from tests.helpers.processes import kill_started

# Two cores here and on CI: extra intra-op threads only add contention between test processes, and with
# pytest-xdist's workers (scripts/run_tests.sh) the cores are shared between them.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
torch.set_num_threads(max(1, min(2, torch.get_num_threads()) // _WORKERS))

INTEGRATION_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "integration: under tests/integration/ (CLI runs, several ranks, faults); "
        "`pytest -m 'not integration'` is the unit tier",
    )
    config.addinivalue_line("markers", "faults: kill -9 fault suite (starts ~10 training processes)")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one; `pytest -m gpu` on a GPU machine)")


def pytest_collection_modifyitems(config, items):
    """The tier is where the file lives: everything under tests/integration/ is marked ``integration``."""
    for item in items:
        if os.path.commonpath([str(item.path), INTEGRATION_DIR]) == INTEGRATION_DIR:
            item.add_marker(pytest.mark.integration)


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


@pytest.fixture(autouse=True)
def kill_started_processes():
    """Whatever a test started with ``tests.helpers.processes.start`` and left running is killed when it ends
    (passed, failed or interrupted), so no training outlives the test that started it."""
    yield
    kill_started()


@pytest.fixture(autouse=True)
def cpu_matmul_choice_stays_in_its_test():
    """A command run in this process (``train``, eval-lm) sets the process's fp32 CPU matmul library
    (``toolkit.ops.select``: the decision and the mode that puts it in force); the next test starts as the test
    before it did (undecided, no mode: a fresh process)."""
    from toolkit import ops

    before = ops.chosen()
    yield
    ops.restore(before)
