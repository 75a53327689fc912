"""The per-machine caches (``toolkit/core/machine_cache.py``): what a file says is believed only when it is a
measurement, and a measurement taken while other processes used the CPUs is provisional.

These cases cannot be written as a command line (the catalogue's form): each writes the cache file itself, in a
``$TOOLKIT_CACHE_DIR`` of its own, and counts the measurements.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import processes
from toolkit.core import cpu_gemm, machine_cache
from toolkit.logging import throughput

KEY = "this machine | 1 threads"
#: what hand edits, other tools and broken writers put in a cache (each read as no measurement)
NOT_MEASUREMENTS = ["1e30", "1e-3", "true", "Infinity", "-Infinity", "NaN", "-5", "0", '"5e10"', "null", "[5e10]"]


@pytest.fixture
def quiet(monkeypatch):
    """The machine as quiet as a measurement needs (the real one is shared: its load is not the test's)."""
    monkeypatch.setattr(machine_cache, "measure_while_watching", lambda measure: (measure(), 0.0))


def _counting(value: float):
    calls = []

    def measure() -> float:
        calls.append(1)
        return value

    return measure, calls


def _write(path, value: str, **extra) -> None:
    entry = ", ".join([f'"flops": {value}', *(f'"{k}": {json.dumps(v)}' for k, v in extra.items())])
    path.write_text(f'{{"{KEY}": {{{entry}}}}}')


@pytest.mark.parametrize("value", NOT_MEASUREMENTS)
def test_a_kept_value_that_is_no_measurement_is_measured_again(value, tmp_path, quiet, caplog):
    file = tmp_path / "peak.json"
    _write(file, value, busy=0.0, measured=time.strftime("%Y-%m-%d %H:%M:%S"))
    measure, calls = _counting(5e10)
    got, measured = machine_cache.kept_or_measured(str(file), KEY, "flops", measure, within=(1e7, 1e13))
    assert (got, measured, len(calls)) == (5e10, None, 1)
    assert json.loads(file.read_text())[KEY]["flops"] == 5e10  # replaced
    assert "is not a measurement" in caplog.text and str(file) in caplog.text


def test_a_plausible_quiet_value_is_kept(tmp_path, quiet):
    file = tmp_path / "peak.json"
    _write(file, "1.05e11", busy=0.02, measured="2026-01-02 03:04:05")
    measure, calls = _counting(5e10)
    assert machine_cache.kept_or_measured(str(file), KEY, "flops", measure, within=(1e7, 1e13)) == (
        1.05e11,
        "2026-01-02 03:04:05",
    )
    assert not calls


def test_a_busy_measurement_is_provisional_and_measured_again_an_hour_later(tmp_path, monkeypatch):
    """53.7 GFLOP/s measured while another process ran: used meanwhile, replaced by the quiet 105 an hour later;
    the quiet figure is then kept for good."""
    file = tmp_path / "peak.json"
    busy = iter([0.5, 0.0])
    monkeypatch.setattr(machine_cache, "measure_while_watching", lambda measure: (measure(), next(busy)))
    figures = iter([53.7e9, 105e9])
    calls = []

    def measure():
        calls.append(1)
        return next(figures)

    assert machine_cache.kept_or_measured(str(file), KEY, "flops", measure)[0] == 53.7e9
    entry = json.loads(file.read_text())[KEY]
    assert entry["busy"] == 0.5
    value, measured = machine_cache.kept_or_measured(str(file), KEY, "flops", measure)
    assert value == 53.7e9 and "on a busy machine" in measured and len(calls) == 1  # within the hour: used
    entry["measured"] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() - 2 * 3600))
    file.write_text(json.dumps({KEY: entry}))
    assert machine_cache.kept_or_measured(str(file), KEY, "flops", measure)[0] == 105e9  # an hour on: again
    assert machine_cache.kept_or_measured(str(file), KEY, "flops", measure)[0] == 105e9
    assert len(calls) == 2 and json.loads(file.read_text())[KEY]["busy"] == 0.0


def test_an_entry_that_does_not_say_how_busy_the_machine_was_is_provisional(tmp_path, quiet):
    """What a run kept before the load check (no ``busy``): measured again once, then kept for good."""
    file = tmp_path / "peak.json"
    _write(file, "5.37e10", measured="2026-01-02 03:04:05")
    measure, calls = _counting(1.05e11)
    assert machine_cache.kept_or_measured(str(file), KEY, "flops", measure)[0] == 1.05e11
    assert machine_cache.kept_or_measured(str(file), KEY, "flops", measure)[0] == 1.05e11
    assert len(calls) == 1


def test_other_processes_on_the_cpus_make_the_measurement_busy():
    """Real load: two busy loops (one per core here) while the measurement sleeps; their CPU time is others'.
    The bound is loose on purpose: a shared machine only adds to it."""
    loops = [
        processes.start([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL)
        for _ in range(min(2, torch.get_num_threads() + 1))
    ]
    time.sleep(0.3)  # running
    _, busy = machine_cache.measure_while_watching(lambda: time.sleep(1.0))
    for loop in loops:
        loop.kill()
    assert busy > machine_cache.BUSY_LIMIT


def test_busy_share_counts_the_others_cpu_time_not_this_process(monkeypatch):
    """(machine busy seconds, own CPU seconds) before and after 1 s on 2 CPUs."""
    monkeypatch.setattr(machine_cache.os, "cpu_count", lambda: 2)
    assert machine_cache.busy_share((100.0, 10.0), (101.0, 11.0), 1.0) == 0.0  # all of it ours
    assert machine_cache.busy_share((100.0, 10.0), (102.0, 11.0), 1.0) == 0.5  # one core's worth of others'
    assert machine_cache.busy_share((None, 10.0), (None, 11.0), 1.0) == 0.0  # no /proc/stat: not known busy


# --- the two caches read through it -------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1e30", "1e-3", "true", "Infinity"])
def test_cpu_peak_cache_holding_no_measurement_is_measured_again(value, tmp_path, monkeypatch, quiet):
    """``1e30`` made every MFU 0, ``1e-3`` and ``true`` made it 100%, ``Infinity`` 0: now measured again."""
    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(throughput, "_cpu_peak_cache", {})
    key = throughput._machine_key(torch.float32, 1)
    (tmp_path / throughput.CPU_PEAK_CACHE).write_text(f'{{"{key}": {{"flops": {value}, "busy": 0.0}}}}')
    monkeypatch.setattr(throughput, "best_matmul_flops", lambda *a, **k: 8e10)
    assert throughput.measure_cpu_peak_flops(torch.float32, threads=1) == 8e10
    assert json.loads((tmp_path / throughput.CPU_PEAK_CACHE).read_text())[key]["flops"] == 8e10


def test_cpu_peak_range_grows_with_threads():
    assert throughput.plausible_cpu_peak(1) == (1e7, 1e13)
    assert throughput.plausible_cpu_peak(8) == (8e7, 8e13)


@pytest.mark.parametrize("value", ["1e30", "0", "true", "Infinity", '"fast"'])
def test_matmul_choice_cache_holding_no_measurement_is_measured_again(value, tmp_path, monkeypatch, quiet):
    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(cpu_gemm._state, "onednn", None)
    monkeypatch.setattr(cpu_gemm, "onednn_available", lambda: True)
    key = machine_cache.key(f"{torch.get_num_threads()} threads")
    (tmp_path / cpu_gemm.CACHE_NAME).write_text(f'{{"{key}": {{"speedup": {value}, "busy": 0.0}}}}')
    monkeypatch.setattr(cpu_gemm, "measure_speedup", lambda threads=None: 0.9)
    assert not cpu_gemm.select("auto")  # the measurement's answer (0.9: torch), not the file's
    assert json.loads((tmp_path / cpu_gemm.CACHE_NAME).read_text())[key]["speedup"] == 0.9
