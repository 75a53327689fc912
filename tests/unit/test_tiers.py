"""The suite's layout holds: every test file is in a tier, and tests import helpers, never each other.

scripts/run_tests.sh runs tests/unit and tests/integration only, so a test file left at tests/ top level
would silently never run in CI; a test importing another test module ties the two files' fates together.
"""

import ast
import os

from tests.helpers import REPO_ROOT

TESTS = os.path.join(REPO_ROOT, "tests")


def python_files(folder: str):
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            if name.endswith(".py"):
                yield os.path.join(root, name)


def test_every_test_file_is_in_a_tier():
    stray = [
        os.path.relpath(p, REPO_ROOT)
        for p in python_files(TESTS)
        if os.path.basename(p).startswith("test_")
        and os.path.relpath(p, TESTS).split(os.sep)[0] not in ("unit", "integration")
    ]
    assert not stray, f"move these into tests/unit/ (in-process) or tests/integration/ (processes): {stray}"


def test_tests_import_only_the_helpers_package():
    found = []
    for path in python_files(TESTS):
        for node in ast.walk(ast.parse(open(path).read(), path)):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "tests" and len(parts) > 1 and parts[1] not in ("helpers",):
                    found.append(f"{os.path.relpath(path, REPO_ROOT)}:{node.lineno}: {name}")
    assert not found, "put what is shared into tests/helpers/:\n" + "\n".join(found)
