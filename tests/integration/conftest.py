"""Fixtures shared by integration tests of more than one module, and the order the tier's files are handed out in."""

import os
from collections import Counter

import pytest

from tests.helpers.bad_inputs import prepare


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """The bad-input catalogue's files (tests/helpers/bad_inputs.py): two trainings, made once for both catalogue
    modules. Every case asserts it changed none of them; test_bad_inputs_writers_and_checksums only adds folders beside them."""
    yield from prepare(str(tmp_path_factory.mktemp("catalogue")))


# The tier's longest files (a minute or more of wall time each on two workers: GPU-figure dry runs, fault
# injection, compiled and multi-rank comparisons), longest first. ``--dist loadfile`` hands files out in the
# collection's order (scripts/run_tests.sh turns off xdist's reordering by test count, which would put these
# few-test files last): started first, they end while the short files fill the other worker, instead of one
# of them running alone at the end.
LONGEST_FIRST = (
    "test_pipeline_parallel.py",
    "test_llama_onnx.py",
    "test_gpu_sh.py",
    "test_distributed.py",
    "test_fp8.py",
    "test_faults.py",
    "test_moe_hf.py",
    "test_moe_train.py",
    "test_context_parallel.py",
    "test_lora.py",
    "test_tensor_parallel.py",
    "test_composition.py",
)
INTEGRATION_DIR = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    """The integration files: ``LONGEST_FIRST``, then the others by their number of tests (most first, as xdist's
    own reordering does), each file's tests together and in their order; the positions of other tiers' tests kept."""
    where = [i for i, item in enumerate(items) if os.path.dirname(str(item.path)) == INTEGRATION_DIR]
    ours = [items[i] for i in where]
    counts = Counter(str(item.path) for item in ours)
    first_seen = {}
    for item in ours:
        first_seen.setdefault(str(item.path), len(first_seen))

    def rank(item):
        name, path = os.path.basename(str(item.path)), str(item.path)
        long_rank = LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
        return long_rank, -counts[path], first_seen[path]

    for i, item in zip(where, sorted(ours, key=rank)):
        items[i] = item
