"""One JSON line per ``benchmarks/gpu.sh`` figure, read off the entry's log (called by gpu.sh).

    python -m benchmarks.figure NAME --log LOG --rc RC --seconds S [--memory PEAK.json] [--out FILE]

What it reads from the log (whichever is there):

* the entry's command (``gpu.sh``'s ``=== NAME: COMMAND`` line), as ``command``: what
  ``benchmarks.plan_calibration`` plans again for the same layout;
* the last ``{"benchmark": ...}`` line a benchmark prints (:class:`benchmarks.timing.Report`: tokens/s, MFU,
  the time split of ``benchmarks.train``; tokens/s of ``benchmarks.generate``), as ``result``;
* toolkit-train's ``--log-format json`` lines: ``words_per_s`` = the median of ``wps`` over updates 2..N
  (the first one pays the start-up), ``updates`` = the last update logged, and ``params`` from its
  ``num. model params`` line;
* toolkit-train ``--plan``'s ``plan: ...`` line, the planner's prediction for the same flags, as ``plan``;
* ``--memory``: ``benchmarks.peak_memory``'s JSON (peak host resident set of the process tree, peak
  GPU memory in use); with ``params`` known, ``host_bytes_per_param`` = peak host bytes / parameters.

Appends the line to ``--out`` (default: stdout only) and prints it. A figure whose command failed or
timed out still gets its line (``rc`` says so), so a session's results file lists every entry it ran.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Dict, List, Optional

from benchmarks.timing import median

COMMAND = re.compile(r"^=== [\w.-]+: (.*)$")
JSON_LINE = re.compile(r"(\{.*\})\s*$")
PARAMS = re.compile(r"num\. model params: (\d+)")
PLAN = re.compile(r"\bplan: (.*)$")


def _json_objects(lines: List[str]) -> List[Dict[str, Any]]:
    out = []
    for line in lines:
        m = JSON_LINE.search(line)
        if not m:
            continue
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def read_log(path: str) -> Dict[str, Any]:
    """The figures a log holds (see the module docstring); absent ones are left out."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    objects = _json_objects(lines)
    found: Dict[str, Any] = {}
    results = [o for o in objects if "benchmark" in o and o["benchmark"] != "peak_memory"]  # that one: --memory
    if results:
        found["result"] = results[-1]
    updates = [o for o in objects if "wps" in o and ("num_updates" in o or "update" in o)]
    if updates:
        steps = [(float(o.get("num_updates", o.get("update"))), float(o["wps"])) for o in updates]
        later = [w for u, w in steps if u >= 2] or [w for _, w in steps]
        found["words_per_s"] = round(median(later), 1)
        found["updates"] = int(max(u for u, _ in steps))
    commands = [m.group(1) for m in map(COMMAND.match, lines) if m]
    if commands:
        found["command"] = commands[-1]  # a dry run's shared log: the command the CPU ran
    for line in lines:
        m = PARAMS.search(line)
        if m:
            found["params"] = int(m.group(1))
        m = PLAN.search(line)
        if m:
            found["plan"] = m.group(1).strip()
    return found


def figure(name: str, log: str, rc: int, seconds: float, memory: Optional[str], dry_run: bool) -> Dict[str, Any]:
    line: Dict[str, Any] = {"figure": name, "rc": rc, "seconds": seconds, "dry_run": dry_run}
    if rc in (124, 137):
        line["timed_out"] = True
    line.update(read_log(log))
    if memory and os.path.exists(memory):
        with open(memory) as f:
            mem = json.load(f)
        line["peak_host_gib"] = mem.get("peak_host_rss_gib")
        line["peak_gpu_used_gib"] = mem.get("peak_gpu_used_gib")
        if line.get("params") and mem.get("peak_host_rss_gib") is not None:
            line["host_bytes_per_param"] = round(mem["peak_host_rss_gib"] * 2**30 / line["params"], 2)
    line["log"] = log
    return line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name")
    ap.add_argument("--log", required=True)
    ap.add_argument("--rc", type=int, required=True)
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--memory", default=None, help="benchmarks.peak_memory's --json file")
    ap.add_argument("--dry-run", action="store_true", help="the CPU dry run's line (tiny shapes)")
    ap.add_argument("--out", default=None, help="append the line to this file")
    args = ap.parse_args(argv)
    text = json.dumps(figure(args.name, args.log, args.rc, args.seconds, args.memory, args.dry_run))
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
