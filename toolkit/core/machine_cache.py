"""Small per-machine measurements kept between runs (the CPU's matmul peak, which BLAS is faster), one JSON file
each under ``$TOOLKIT_CACHE_DIR`` or ``~/.cache/toolkit``, keyed by what makes the figure change: CPU model, core
count and torch build (the caller adds dtype, threads).

Why a file: a machine's figures do not change between runs, and measuring them took up to a second of every
start. Writes go to a temporary name and are renamed, so runs starting together lose nothing but a duplicate
measurement; a cache that cannot be read or written only costs the next run a measurement.
"""

from __future__ import annotations

import json
import logging
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


def kept_or_measured(
    file: str, entry_key: str, field: str, measure: Callable[[], float]
) -> Tuple[float, Optional[str]]:
    """(the positive number ``field`` kept under ``entry_key`` in ``file``, when it was measured), or, when there is
    none (an absent or cut-short file, another machine), ``(measure(), None)`` after keeping that figure."""
    kept = read(file).get(entry_key)
    if isinstance(kept, dict) and isinstance(kept.get(field), (int, float)) and kept[field] > 0:
        return float(kept[field]), str(kept.get("measured", "?"))
    value = measure()
    write(file, entry_key, {field: value})
    return value, None


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
