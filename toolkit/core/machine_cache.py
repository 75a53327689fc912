"""Small per-machine measurements kept between runs (the CPU's matmul peak, which BLAS is faster), one JSON file
each under ``$TOOLKIT_CACHE_DIR`` or ``~/.cache/toolkit``, keyed by what makes the figure change: CPU model, core
count and torch build (the caller adds dtype, threads).

Why a file: a machine's figures do not change between runs, and measuring them took up to a second of every
start. Writes go to a temporary name and are renamed, so runs starting together lose nothing but a duplicate
measurement; a cache that cannot be read or written only costs the next run a measurement.

What is read is checked before it is believed: a number (not a bool, a string or infinity) within the range the
caller says a real measurement falls in (``plausible``; :data:`PLAUSIBLE` for the shared fields); anything else
is measured again and replaced, with a warning naming the file. A figure that every MFU of every later run is
divided by must not be whatever the file says.

A measurement made while other processes used the CPUs (:func:`busy_share` above :data:`BUSY_LIMIT`) is kept
as provisional, not as the machine's figure: on a busy machine the matmuls share cores and the peak comes out low
(53.7 GFLOP/s where the quiet machine gives 105), which would inflate every MFU printed after it until the file is
deleted. Later runs use a provisional figure (measuring at every start on a machine that stays busy, a shared CI
runner for one, would cost each run a second and measure no better), and measure again once it is an hour old
(:data:`RETRY_BUSY_S`), until a quiet measurement replaces it for good. An entry that does not say how busy the
machine was (written before this check) is provisional too. Why this test: the CPU time other processes used
*during* the measurement (``/proc/stat`` less this process's own) says directly whether anything competed with
it; the load average lags by a minute and counts waiting tasks, and measuring twice in a row only helps when the
load comes and goes between the two.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import tempfile
import time
from typing import Any, Callable, Dict, Optional, Tuple

import torch

logger = logging.getLogger(__name__)


def path(name: str) -> str:
    """Where the cache called ``name`` lives: ``$TOOLKIT_CACHE_DIR/name`` or ``~/.cache/toolkit/name``."""
    root = os.environ.get("TOOLKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "toolkit")
    return os.path.join(root, name)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def key(*parts: str) -> str:
    """This machine's key: the CPU model, core count, torch build, then ``parts``."""
    return " | ".join([cpu_model(), f"{os.cpu_count()} CPUs", f"torch {torch.__version__}", *parts])


def read(file: str) -> Dict[str, Any]:
    try:
        with open(file) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):  # absent, or cut short by a full disk: measure again
        return {}


#: the range a real measurement of a shared field falls in (torch's time / oneDNN's: no library is 20x the other)
PLAUSIBLE: Dict[str, Tuple[float, float]] = {"speedup": (0.05, 20.0)}
#: the share of the machine's CPU time other processes may use during a measurement kept for good
BUSY_LIMIT = 0.1
#: a provisional (busy) measurement is measured again once it is this old
RETRY_BUSY_S = 3600.0


def plausible(value: Any, low: float, high: float) -> bool:
    """A finite int or float (not a bool) within [low, high]."""
    return type(value) in (int, float) and math.isfinite(value) and low <= value <= high


def _provisional(entry: Dict[str, Any]) -> bool:
    """Measured while other processes used the CPUs, or without saying how busy the machine was."""
    return not (plausible(entry.get("busy"), 0.0, 1.0) and entry["busy"] <= BUSY_LIMIT)


def _age_s(entry: Dict[str, Any]) -> float:
    try:
        return time.time() - time.mktime(time.strptime(str(entry.get("measured")), "%Y-%m-%d %H:%M:%S"))
    except (ValueError, OverflowError):
        return math.inf


def kept_or_measured(
    file: str,
    entry_key: str,
    field: str,
    measure: Callable[[], float],
    within: Optional[Tuple[float, float]] = None,
) -> Tuple[float, Optional[str]]:
    """(the number ``field`` kept under ``entry_key`` in ``file``, when it was measured), or ``(measure(), None)``
    (kept for the next runs) when there is none (an absent or cut-short file, another machine), when it is not a
    number ``within`` the range a measurement falls in (default :data:`PLAUSIBLE`'s, else any positive number),
    or when it is a provisional figure an hour old (see the module docstring)."""
    low, high = within or PLAUSIBLE.get(field, (math.ulp(0.0), math.inf))
    kept = read(file).get(entry_key)
    value = kept.get(field) if isinstance(kept, dict) else None
    if plausible(value, low, high):
        if not _provisional(kept):
            return float(value), str(kept.get("measured", "?"))
        if _age_s(kept) < RETRY_BUSY_S:
            return float(value), f"{kept.get('measured', '?')} on a busy machine; measured again after an hour"
    elif kept is not None:
        logger.warning(
            f"{file}: {field} {value if value is not None else kept!r} is not a measurement (a number in "
            f"[{low:g}, {high:g}]); measuring it again"
        )
    value, busy = measure_while_watching(measure)
    if busy > BUSY_LIMIT:
        logger.warning(
            f"other processes used {busy:.0%} of this machine's CPU time while its {field} was measured: kept in "
            f"{file} as provisional (measured again in an hour, until the machine is quiet)"
        )
    write(file, entry_key, {field: value, "busy": round(busy, 3)})
    return value, None


def _cpu_seconds() -> Tuple[Optional[float], float]:
    """(the machine's busy CPU seconds so far, from /proc/stat; None where unknown), this process's CPU seconds."""
    own = sum(os.times()[:2])
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None, own
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), own


def busy_share(before: Tuple[Optional[float], float], after: Tuple[Optional[float], float], wall: float) -> float:
    """The share of the machine's CPU time (all its CPUs over ``wall`` seconds) other processes used between two
    :func:`_cpu_seconds` readings; 0 where the system does not say."""
    if before[0] is None or after[0] is None or wall <= 0:
        return 0.0
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others) / (wall * (os.cpu_count() or 1))


def measure_while_watching(measure: Callable[[], float]) -> Tuple[float, float]:
    """(``measure()``, :func:`busy_share` during it)."""
    before, start = _cpu_seconds(), time.monotonic()
    value = measure()
    return value, busy_share(before, _cpu_seconds(), time.monotonic() - start)


def write(file: str, entry_key: str, entry: Dict[str, Any]) -> None:
    """Adds one entry (with the time it was measured): read, merge, write to a temporary name, rename."""
    try:
        os.makedirs(os.path.dirname(file), exist_ok=True)
        entries = read(file)
        entries[entry_key] = {**entry, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(file), prefix="." + os.path.basename(file) + ".", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1, sort_keys=True)
        os.replace(tmp, file)
    except OSError as e:
        logger.warning(f"could not keep a measurement in {file} ({e}); the next run measures it again")
