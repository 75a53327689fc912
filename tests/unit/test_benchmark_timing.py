"""benchmarks/timing.py, the one way benchmarks time and report: contestants alternate round by round after the
warm-up, each keeps min / median / max of its rounds, ratios are of the medians, and a result is one JSON line
with the command and the machine's facts. No timing is asserted: the clock is replaced by a counter.

And the rule it stands for, checked over the files: no benchmark edits ``sys.path`` (they run as
``python -m benchmarks.NAME``), reads the clock itself or computes a median of its own.
"""

from __future__ import annotations

import ast
import io
import itertools
import json
import os
import threading

import pytest

from benchmarks import timing
from tests.helpers import REPO_ROOT

BENCHMARKS = os.path.join(REPO_ROOT, "benchmarks")


@pytest.fixture
def ticking(monkeypatch):
    """The benchmarks' clock as a counter: each read is one second after the last."""
    ticks = itertools.count()
    monkeypatch.setattr(timing, "now", lambda: float(next(ticks)))


def test_contestants_alternate_round_by_round_after_the_warmup(ticking):
    order = []
    contestants = {name: (lambda name=name: order.append(name) or name.upper()) for name in ("a", "b", "c")}
    stats = timing.alternate(contestants, rounds=3, warmup=2)
    assert order == ["a", "b", "c"] * 5
    assert {name: len(s.seconds) for name, s in stats.items()} == {"a": 3, "b": 3, "c": 3}  # warm-up left out
    assert all(s.seconds == [1.0, 1.0, 1.0] for s in stats.values())  # one tick between the two reads of a call
    assert stats["b"].last == "B"


def test_a_contestant_that_times_itself_gives_its_own_seconds(ticking):
    rounds = iter([(9.0, "x"), (2.0, "y"), (4.0, "z"), (7.0, "w")])
    stats = timing.alternate({"child": lambda: timing.Measured(*next(rounds))}, rounds=3, warmup=1)
    assert stats["child"].seconds == [2.0, 4.0, 7.0] and stats["child"].last == "w"


def test_cpu_seconds_count_this_process_work_not_its_waits():
    start = timing.cpu_now()
    total = sum(i * i for i in range(200_000))
    busy = timing.cpu_now() - start
    start = timing.cpu_now()
    threading.Event().wait(0.2)
    waited = timing.cpu_now() - start
    assert total > 0 and busy > 0
    assert waited < 0.1  # a wall clock reads at least 0.2 across the wait, whatever the load


def test_stats_are_min_median_max_and_ratios_are_of_medians():
    fast, slow = timing.Stats([3.0, 1.0, 2.0, 10.0]), timing.Stats([4.0, 6.0, 5.0])
    assert (fast.min, fast.median, fast.max) == (1.0, 2.5, 10.0)
    assert fast.rate(10.0) == 4.0  # work per second at the median round
    assert timing.ratios({"fast": fast, "slow": slow}, baseline="fast") == {"fast": 1.0, "slow": 2.0}
    with pytest.raises(ValueError):
        timing.alternate({"a": lambda: None}, rounds=0)


def test_one_json_line_with_the_contestants_the_command_and_the_machine(tmp_path, ticking):
    results = tmp_path / "figures.jsonl"
    report = timing.Report("toy", argv=["--rows", "8", "--name", "a b"], script=os.path.join(BENCHMARKS, "toy.py"))
    stats = timing.alternate({"ours": lambda: None, "theirs": lambda: None}, rounds=2)
    stream = io.StringIO()
    line = report.emit(stats, baseline="theirs", results=str(results), stream=stream, rows=8)
    report.emit(results=str(results), stream=stream, rows=9)
    printed = [json.loads(text) for text in stream.getvalue().splitlines()]
    assert printed[0] == line and len(printed) == 2
    assert [json.loads(text) for text in results.read_text().splitlines()] == printed  # appended, one per result
    assert line["benchmark"] == "toy" and line["rows"] == 8 and line["baseline"] == "theirs"
    assert set(line["contestants"]["ours"]) >= {"min_s", "median_s", "max_s", "rounds", "seconds"}
    assert line["contestants"]["ours"]["rounds"] == 2 and line["ratios"] == {"ours": 1.0, "theirs": 1.0}
    assert line["command"] == "python -m benchmarks.toy --rows 8 --name 'a b'"
    machine = line["machine"]
    assert {"cpu", "cpus", "threads", "torch", "device", "python", "loadavg_start", "loadavg_end"} <= set(machine)
    assert machine["device"] == "cpu" and machine["cpus"] == os.cpu_count()
    assert "contestants" not in printed[1] and printed[1]["rows"] == 9


def test_a_bare_results_name_goes_under_benchmarks_results(tmp_path):
    assert timing.results_path("peers.jsonl") == timing.RESULTS / "peers.jsonl"
    assert str(timing.results_path(str(tmp_path / "x.jsonl"))) == str(tmp_path / "x.jsonl")


def benchmark_files():
    for root, _, names in os.walk(BENCHMARKS):
        for name in sorted(names):
            if name.endswith(".py") and os.path.join(root, name) != timing.__file__:
                yield os.path.join(root, name)


CLOCKS = ("perf_counter", "time", "monotonic", "process_time", "perf_counter_ns", "monotonic_ns", "time_ns")


def own_timing(tree: ast.AST):
    """What a benchmark must take from benchmarks.timing instead: (line, what) for each."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) == ("sys", "path"):
                yield node.lineno, "edits sys.path (run it as python -m benchmarks.NAME)"
            if node.attr in CLOCKS and (node.value.id == "time" or node.attr == "perf_counter"):
                yield node.lineno, "reads the clock itself (timing.now, cpu_now, time_call, alternate)"
            if node.attr == "median" and node.value.id in ("statistics", "np", "numpy", "torch"):
                yield node.lineno, "computes its own median (timing.median, Stats)"
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if "statistics" in names:
                yield node.lineno, "imports statistics (timing.median, Stats)"
        elif isinstance(node, (ast.FunctionDef, ast.Lambda)) and "median" in getattr(node, "name", ""):
            yield node.lineno, "defines its own median"


def test_no_benchmark_edits_sys_path_or_times_on_its_own():
    found = [
        f"{os.path.relpath(path, REPO_ROOT)}:{line}: {what}"
        for path in benchmark_files()
        for line, what in own_timing(ast.parse(open(path).read(), path))
    ]
    assert len(list(benchmark_files())) > 30  # the walk sees the scripts
    assert not found, "\n".join(found)


def test_the_check_finds_each_kind_of_private_timing():
    snippet = (
        "import statistics, sys, time\n"
        "sys.path.insert(0, '.')\n"
        "def step_median(xs):\n"
        "    return statistics.median(xs)\n"
        "t0 = time.perf_counter()\n"
        "c0 = time.process_time()\n"
        "s0 = time.time()\n"
    )
    assert sorted(line for line, _ in own_timing(ast.parse(snippet))) == [1, 2, 3, 4, 5, 6, 7]
