"""How every benchmark here times and reports: alternated rounds, min / median / max, one JSON line.

Why alternated rounds: on a shared machine a neighbour's load comes and goes within seconds. Running all of
contestant A's rounds, then all of B's, lets one of them meet a load the other never saw; running them
A B A B ... (after ``warmup`` discarded rounds, which pay the one-off costs: allocation, caches, kernel choice)
exposes both to the same machine, so their medians compare. The fastest and the slowest round say how noisy
that machine was. On a GPU each call is bracketed by ``torch.cuda.synchronize``, so a round is the work done,
not the work queued.

One result is one JSON line (:class:`Report`): the benchmark's name and figures, each contestant's rounds with
their min / median / max, the ratios of the medians to a baseline, the command that produced it and the
machine's facts (CPU model, threads, torch, device, the load average when the benchmark started and ended).
``--results FILE`` (:func:`add_results_flag`) also appends the line to ``FILE``, a bare name going under
``benchmarks/results/``.

    from benchmarks.timing import Report, add_results_flag, alternate

    report = Report("fused_loss")  # facts taken now: the load average at the start
    stats = alternate({"logits": lambda: step("logits"), "fused": lambda: step("512")}, rounds=5, warmup=1)
    report.emit(stats, baseline="logits", results=args.results, rows=args.rows)

Scripts run from the repository root as modules (``python -m benchmarks.fused_loss``); the toolkit itself is
installed (editable), so nothing edits ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

BENCHMARKS = pathlib.Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
RESULTS = BENCHMARKS / "results"


def module_argv(name: str) -> List[str]:
    """The command that runs ``benchmarks.NAME`` in a fresh interpreter (with ``cwd=REPO``, as every benchmark
    runs: the checkout's ``benchmarks`` and ``toolkit`` come first on the path)."""
    return [sys.executable, "-m", f"benchmarks.{name}"]


def now() -> float:
    """The clock every benchmark reads (monotonic, the finest the platform has), for marks inside a round."""
    return time.perf_counter()


def cpu_now() -> float:
    """This process's CPU seconds (all its threads): what a step costs whatever the neighbours' load, where the
    wall clock (:func:`now`) says what it took."""
    return time.process_time()


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


@dataclass
class Stats:
    """One contestant's timed rounds (seconds, in the order they ran) and what its last round returned."""

    seconds: List[float]
    last: Any = None
    extra: Dict[str, Any] = field(default_factory=dict)

    @property
    def min(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return median(self.seconds)

    @property
    def max(self) -> float:
        return max(self.seconds)

    def rate(self, work: float) -> float:
        """``work`` units per second at the median round (tokens/s from tokens per round)."""
        return work / self.median

    def as_dict(self) -> Dict[str, Any]:
        return {
            "min_s": self.min,
            "median_s": self.median,
            "max_s": self.max,
            "rounds": len(self.seconds),
            "seconds": [round(s, 6) for s in self.seconds],
            **self.extra,
        }


class Measured(NamedTuple):
    """What a contestant returns when it times itself (a child process's own clock, a tool's logged rate):
    ``seconds`` stands for the round instead of the wall time around the call."""

    seconds: float
    value: Any = None


def synchronize(device: Any = None) -> None:
    """Wait for the GPU's queue when ``device`` is a CUDA device (a no-op otherwise)."""
    if device is not None and str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: Any = None) -> Tuple[float, Any]:
    """(seconds, value) of one call of ``fn``: synchronized before and after on a CUDA ``device``; a
    :class:`Measured` value gives its own seconds."""
    synchronize(device)
    start = now()
    value = fn()
    synchronize(device)
    seconds = now() - start
    if isinstance(value, Measured):
        return value.seconds, value.value
    return seconds, value


def alternate(
    contestants: Mapping[str, Callable[[], Any]], rounds: int, warmup: int = 0, device: Any = None
) -> Dict[str, Stats]:
    """Each contestant called once per round, in the mapping's order, round after round (A B A B ...); the first
    ``warmup`` rounds are run and discarded. Returns each contestant's :class:`Stats` over the ``rounds`` timed."""
    if rounds < 1:
        raise ValueError(f"alternate: rounds must be at least 1, not {rounds}")
    stats = {name: Stats([]) for name in contestants}
    for r in range(warmup + rounds):
        for name, fn in contestants.items():
            seconds, value = time_call(fn, device)
            stats[name].last = value
            if r >= warmup:
                stats[name].seconds.append(seconds)
    return stats


def repeat(fn: Callable[[], Any], rounds: int, warmup: int = 0, device: Any = None) -> Stats:
    """One contestant alone: :func:`alternate` with nothing to alternate with."""
    return alternate({"only": fn}, rounds, warmup, device)["only"]


def ratios(stats: Mapping[str, Stats], baseline: str) -> Dict[str, float]:
    """Each contestant's median over the baseline's (above 1: slower than the baseline)."""
    base = stats[baseline].median
    return {name: s.median / base for name, s in stats.items()}


def load_average() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what the platform says where that is not readable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _torch_facts(device: Any) -> Dict[str, Any]:
    """torch's version and threads where the benchmark imported it (a torch-free benchmark stays torch-free)."""
    torch = sys.modules.get("torch")
    if torch is None:
        from importlib import metadata

        try:
            return {"torch": metadata.version("torch"), "threads": None}
        except metadata.PackageNotFoundError:
            return {"torch": None, "threads": None}
    facts: Dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if device is not None and str(device).startswith("cuda") and torch.cuda.is_available():
        facts.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return facts


def machine_facts(device: Any = None) -> Dict[str, Any]:
    """What a figure depends on besides the code: CPU model and count, threads, torch, device, Python."""
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "device": str(device) if device is not None else "cpu",
        **_torch_facts(device),
        "python": platform.python_version(),
    }


def module_command(argv: Sequence[str], script: Optional[str] = None) -> str:
    """The command that reruns this benchmark from the repository root: ``python -m benchmarks.NAME ARGS``."""
    path = pathlib.Path(script or sys.argv[0]).resolve()
    try:
        module = ".".join(path.relative_to(BENCHMARKS.parent).with_suffix("").parts)
    except ValueError:
        module = path.stem
    return "python -m " + module + ("" if not argv else " " + shlex.join(str(a) for a in argv))


def results_path(name: str) -> pathlib.Path:
    """``name`` as given when it holds a folder, else under ``benchmarks/results/``."""
    path = pathlib.Path(name)
    return path if path.parent != pathlib.Path(".") or path.is_absolute() else RESULTS / path


def write_text(path: str, text: str) -> None:
    """``text`` to ``path`` under a temporary name first, so that a reader never sees half a table."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    os.replace(tmp, path)


def add_results_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--results",
        metavar="FILE",
        default=None,
        help="also append the JSON line to FILE (a bare name: under benchmarks/results/)",
    )


class Report:
    """One benchmark result's JSON line. Made when the benchmark starts: the load average then is a fact of
    the result (a busy machine explains a slow figure)."""

    def __init__(self, name: str, device: Any = None, argv: Optional[Sequence[str]] = None, script: str = ""):
        self.name = name
        self.device = device
        self.argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
        self.script = script or None
        self.loadavg_start = load_average()
        self.started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())

    def line(
        self, stats: Optional[Mapping[str, Stats]] = None, baseline: Optional[str] = None, **fields: Any
    ) -> Dict[str, Any]:
        out: Dict[str, Any] = {"benchmark": self.name, **fields}
        if stats:
            out["contestants"] = {name: s.as_dict() for name, s in stats.items()}
            if baseline is not None:
                out["baseline"] = baseline
                out["ratios"] = ratios(stats, baseline)
        out["command"] = module_command(self.argv, self.script)
        out["machine"] = {
            **machine_facts(self.device),
            "loadavg_start": self.loadavg_start,
            "loadavg_end": load_average(),
            "started": self.started,
        }
        return out

    def emit(
        self,
        stats: Optional[Mapping[str, Stats]] = None,
        baseline: Optional[str] = None,
        results: Optional[str] = None,
        stream: Any = None,
        **fields: Any,
    ) -> Dict[str, Any]:
        """Print the line (stdout unless ``stream``) and append it to ``results`` when given; returns it."""
        out = self.line(stats, baseline, **fields)
        text = json.dumps(out)
        print(text, file=stream or sys.stdout, flush=True)
        if results:
            path = results_path(results)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(text + "\n")
        return out
