#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: the unit tier, then the integration tier.
# tests/unit/ is in-process (a few minutes); tests/integration/ starts commands, several ranks and faults
# (marked `integration`). A failing unit tier stops here: the slower tier would only repeat its failure.
# Arguments go to both pytest runs (e.g. -x, -k NAME); a tier that -k/-m leaves empty (pytest's exit 5)
# is not a failure unless both are empty. Each tier runs on TOOLKIT_TEST_WORKERS pytest-xdist workers
# (default 2, one a core here; 0: in the pytest process); the integration tier hands out whole files
# (a file's module fixtures, e.g. its one-process reference runs, are made once), the longest files first
# (tests/integration/conftest.py's LONGEST_FIRST).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# One shape for the code before any test: `ruff format` and `ruff check` (ruff.toml) leave nothing to change.
"${PYTHON:-python3}" -m ruff format --check --quiet . || { echo "run_tests: run 'ruff format .' (the tree is not formatted)"; exit 1; }
"${PYTHON:-python3}" -m ruff check --quiet . || { echo "run_tests: 'ruff check .' found the above"; exit 1; }
workers=${TOOLKIT_TEST_WORKERS:-2}
parallel=()
if [ "$workers" != "0" ]; then
    parallel=(-n "$workers")
fi
unit=0
"${PYTHON:-python3}" -m pytest tests/unit -q "${parallel[@]}" "$@" || unit=$?
if [ "$unit" -ne 0 ] && [ "$unit" -ne 5 ]; then
    exit "$unit"
fi
integration=0
files=()
if [ "$workers" != "0" ]; then
    files=(--dist loadfile --no-loadscope-reorder)  # tests/integration/conftest.py orders the files
fi
"${PYTHON:-python3}" -m pytest tests/integration -q --durations=30 "${parallel[@]}" "${files[@]}" "$@" || integration=$?
if [ "$integration" -eq 5 ] && [ "$unit" -eq 0 ]; then
    integration=0
fi
exit "$integration"
