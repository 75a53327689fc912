"""toolkit-plan's offloaded step against the GPU sessions' measurements, term by term, and the constants that fit.

    python -m benchmarks.plan_calibration benchmarks/results/gpu_figures_h200_*.jsonl
    python -m benchmarks.plan_calibration benchmarks/results/gpu_figures_*.jsonl $OUT/gpu_figures.jsonl --out cal.md

Reads ``benchmarks/gpu.sh``'s figure lines (``benchmarks.figure``): every offload figure that ran to the end with
``--optimizer cpu_adam`` (words/s, peak host and GPU memory, parameters, the ``plan:`` line it logged) and every
``profile_*`` line (``benchmarks.offload_profile``: GPU compute, host <-> GPU bytes and copy time, CPU Adam time).
For each layout it plans the same command again (the line's ``command``; for lines older than that field, what
``bash benchmarks/gpu.sh --print NAME`` runs now) on the card the line names, with toolkit-plan's own code, and
prints per term what the plan says, what was measured and their ratio: the step time (tokens per update / the
measured words/s), host and GPU memory, parameters, and where a profile of the layout exists the copies, their
bytes, CPU Adam and GPU compute.

Then the two constants the offloaded step depends on most, per card: ``--host-link-gbps`` (the GPU <-> host link,
``Hardware.host_link_gbps``) and ``--cpu-adam-gparams`` (``Hardware.cpu_adam_gparams``). From a profile directly
(bytes over copy time, parameters over CPU Adam time); and fitted to every layout's measured step time: the pair
that minimizes the squared log error of ``toolkit.plan.step_time.step_time`` (the planner's own formula, so the
fit says what to set in ``toolkit/plan/hardware.py``'s preset, not what a separate model would want). A fitted
value that can be halved or doubled at almost no cost to the fit is flagged: the measurements do not pin it (a
copy time hidden under compute, for instance). Prints the tables, writes them to ``--out`` (markdown), then one JSON line
(``"benchmark": "plan_calibration"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import shlex
import subprocess
import sys
from typing import Any, Dict, List, Optional, Tuple

from benchmarks.timing import REPO, Report, add_results_flag, write_text

PLAN_CARD = re.compile(r" on (.+?): (?:FITS|DOES NOT FIT)")
CARDS = (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80"))  # as toolkit.plan.hardware.detect_hardware
HOST_LINK = "host <-> GPU copies"
GBPS_RANGE, GPARAMS_RANGE = (1.0, 4000.0), (0.01, 50.0)
GIB = 2**30


def read_lines(paths: List[str]) -> List[Tuple[str, Dict[str, Any]]]:
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            out += [(path, json.loads(line)) for line in f if line.strip()]
    return out


def is_offload_figure(line: Dict[str, Any]) -> bool:
    return (
        line.get("rc") == 0
        and not line.get("dry_run")
        and bool(line.get("words_per_s"))
        and bool(line.get("plan"))
        and bool(line.get("params"))
    )


def profile_result(line: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    result = line.get("result") or {}
    if line.get("rc") == 0 and not line.get("dry_run") and result.get("benchmark") == "offload_profile":
        return result
    return None


def train_argv(line: Dict[str, Any]) -> List[str]:
    """The toolkit-train arguments of the figure's command (its line's, else what gpu.sh runs for it now)."""
    command = line.get("command")
    if not command:
        env = {k: v for k, v in os.environ.items() if k != "DATA"}  # the data-bin gpu.sh prepares, as it ran
        printed = subprocess.run(
            ["bash", "benchmarks/gpu.sh", "--print", line["figure"]], cwd=REPO, env=env, capture_output=True, text=True
        )
        if printed.returncode != 0:
            raise SystemExit(f"plan_calibration: error: {line['figure']}: {printed.stderr.strip()}")
        command = printed.stdout.strip().splitlines()[-1]
    words = shlex.split(command)
    if "toolkit_cli.train" not in words:
        raise SystemExit(f"plan_calibration: error: {line['figure']}: no toolkit_cli.train in its command: {command}")
    return words[words.index("toolkit_cli.train") + 1 :]


def flag_value(argv: List[str], flag: str, default: str) -> str:
    """The value of ``flag``'s last occurrence in ``argv`` (the one toolkit-train's parser keeps)."""
    at = [i for i, a in enumerate(argv[:-1]) if a == flag]
    return argv[at[-1] + 1] if at else default


def card_of(plan_line: str) -> Tuple[str, str]:
    """(the card's name as the plan gave it, toolkit-plan's preset for it)."""
    m = PLAN_CARD.search(plan_line)
    name = m.group(1) if m else "unknown card"
    return name, next((preset for pattern, preset in CARDS if pattern in name), "h100")


def plan_layout(argv: List[str], preset: str, vocab_size: int):
    """toolkit-plan's Plan of ``argv`` on ``preset``: the data-bin when it is here, else ``vocab_size`` words."""
    from toolkit.plan import PRESETS, make_plan
    from toolkit.train.arguments import parse_train_args
    from toolkit.train.resolve import resolve_and_log

    vocab: Optional[int] = None
    if argv and not argv[0].startswith("-"):
        data, argv = argv[0], argv[1:]
        if os.path.isfile(os.path.join(REPO, data, "dict.txt")):
            argv = [os.path.join(REPO, data)] + argv
        else:
            vocab = vocab_size
    logging.getLogger("toolkit").setLevel(logging.ERROR)  # resolve's choices are for training runs
    args, explicit = parse_train_args(argv, "plan_calibration")
    return make_plan(resolve_and_log(args, explicit), PRESETS[preset], vocab_size=vocab)


def host_link(plan) -> Tuple[float, float]:
    """(bytes, seconds) of the plan's host <-> GPU copies (0, 0 without a GPU)."""
    return next(((b, s) for name, b, s in plan.time.comm if name == HOST_LINK), (0.0, 0.0))


def step_with(plan, gbps: float, gparams: float) -> float:
    from toolkit.plan.step_time import step_time

    hw = dataclasses.replace(plan.hw, host_link_gbps=gbps, cpu_adam_gparams=gparams)
    return step_time(plan.stats, plan.setup, hw).total_s


def log_grid(lo: float, hi: float, n: int) -> List[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


def fit(layouts: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The (host link Gb/s, CPU Adam Gparams/s) whose planned step times are closest to the measured ones (squared
    log error), searched on a log grid, then on a finer one around the best point."""

    def loss(gbps: float, gparams: float) -> float:
        return sum(math.log(step_with(r["plan"], gbps, gparams) / r["measured_step_s"]) ** 2 for r in layouts)

    ranges = (GBPS_RANGE, GPARAMS_RANGE)
    best = None
    for _ in range(2):
        grids = [log_grid(lo, hi, 33) for lo, hi in ranges]
        best = min((loss(g, a), g, a) for g in grids[0] for a in grids[1])
        step = [(hi / lo) ** (1 / 32) for lo, hi in ranges]
        ranges = (
            (max(GBPS_RANGE[0], best[1] / step[0]), min(GBPS_RANGE[1], best[1] * step[0])),
            (max(GPARAMS_RANGE[0], best[2] / step[1]), min(GPARAMS_RANGE[1], best[2] * step[1])),
        )
    least, gbps, gparams = best
    moved = {  # the loss with each constant halved and doubled: flat means these runs do not pin it
        "--host-link-gbps": [loss(gbps * f, gparams) for f in (0.5, 2.0)],
        "--cpu-adam-gparams": [loss(gbps, gparams * f) for f in (0.5, 2.0)],
    }
    edge = [flag for flag, losses in moved.items() if min(losses) - least < max(1e-4, 0.01 * least)]
    return {
        "host_link_gbps": gbps,
        "cpu_adam_gparams": gparams,
        "rms_log_error": math.sqrt(best[0] / len(layouts)),
        "unconstrained": edge,
    }


def fit_adam_rate(layouts: List[Dict[str, Any]], gbps: float) -> float:
    """The CPU Adam rate (Gparams/s) closest to ``layouts``' step times with the host link at ``gbps``."""
    lo, hi = GPARAMS_RANGE
    for _ in range(3):
        grid = log_grid(lo, hi, 65)
        best = min(
            grid,
            key=lambda a: sum(math.log(step_with(r["plan"], gbps, a) / r["measured_step_s"]) ** 2 for r in layouts),
        )
        step = (hi / lo) ** (1 / 64)
        lo, hi = max(GPARAMS_RANGE[0], best / step), min(GPARAMS_RANGE[1], best * step)
    return best


def from_profile(profile: Dict[str, Any], plan) -> Dict[str, Optional[float]]:
    """The two constants a profile gives directly: copy bytes over copy time (as the plan's Gb/s, before its
    comm_efficiency), parameters updated over CPU Adam's time."""
    moved, copy_s = profile["h2d_bytes"] + profile["d2h_bytes"], profile["copies_s"]
    gbps = moved * 8 / 1e9 / copy_s / plan.hw.comm_efficiency if copy_s else None
    gparams = profile["params"] / profile["cpu_adam_s"] / 1e9 if profile.get("cpu_adam_s") else None
    return {"host_link_gbps": gbps, "cpu_adam_gparams": gparams}


def layout_row(path: str, line: Dict[str, Any], vocab_size: int) -> Dict[str, Any]:
    argv = train_argv(line)
    card, preset = card_of(line["plan"])
    plan = plan_layout(argv, preset, vocab_size)
    copy_bytes, copy_s = host_link(plan)
    gpu_used = line.get("peak_gpu_used_gib")
    return {
        "figure": line["figure"],
        "source": os.path.basename(path),
        "card": card,
        "preset": preset,
        "optimizer": flag_value(argv, "--optimizer", "adam"),
        "adam_state_precision": flag_value(argv, "--adam-state-precision", "fp32"),
        "plan": plan,
        "measured_step_s": plan.time.tokens_per_step / line["words_per_s"],
        "terms": {
            "step s": (plan.time.total_s, plan.time.tokens_per_step / line["words_per_s"]),
            "host memory GiB": (plan.host_peak_node / GIB, line.get("peak_host_gib")),
            "GPU memory GiB (NVML used)": (plan.gpu_peak / GIB, max(gpu_used) if gpu_used else None),
            "parameters (B)": (plan.stats.num_params / 1e9, line["params"] / 1e9),
            "GPU compute s": (plan.time.compute_s, None),
            "host <-> GPU copies s": (copy_s, None),
            "host <-> GPU GB": (copy_bytes / 1e9, None),
            "CPU Adam s": (plan.time.optimizer_s, None),
        },
    }


def add_profile(row: Dict[str, Any], profile: Dict[str, Any]) -> None:
    terms = row["terms"]
    for term, value in (
        ("GPU compute s", profile["gpu_compute_s"]),
        ("host <-> GPU copies s", profile["copies_s"]),
        ("host <-> GPU GB", (profile["h2d_bytes"] + profile["d2h_bytes"]) / 1e9),
        ("CPU Adam s", profile["cpu_adam_s"]),
    ):
        terms[term] = (terms[term][0], value)
    row["profile"] = from_profile(profile, row["plan"])


def markdown(rows: List[Dict[str, Any]], fits: Dict[str, Dict[str, Any]]) -> str:
    cell = lambda v: "-" if v is None else f"{v:,.3g}"  # noqa: E731
    lines = ["| layout | term | plan | measured | measured / plan |", "| --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        for term, (planned, measured) in r["terms"].items():
            ratio = f"{measured / planned:.2f}" if measured is not None and planned else "-"
            lines.append(
                f"| {r['figure']} ({r['card']}, {r['source']}) | {term} | {cell(planned)} | {cell(measured)} | {ratio} |"
            )
    lines += [
        "",
        "| card | --host-link-gbps | --cpu-adam-gparams | how | step s planned now -> with these / measured |",
    ]
    lines.append("| --- | ---: | ---: | --- | --- |")
    for card, f in fits.items():
        how = f"fit to {f['layouts']} layouts' step times, rms log error {f['rms_log_error']:.2f}"
        if f["unconstrained"]:
            how += f"; not pinned by these runs: {', '.join(f['unconstrained'])}"
        per_precision = "; ".join(f"{p} moments {a:.2f}" for p, a in f["cpu_adam_gparams_by_precision"].items())
        steps = "; ".join(
            f"{r['figure']} {r['plan'].time.total_s:.2f} -> "
            f"{step_with(r['plan'], f['host_link_gbps'], f['cpu_adam_gparams']):.2f} / {r['measured_step_s']:.2f}"
            for r in rows
            if r["card"] == card and r["optimizer"] == "cpu_adam"
        )
        lines.append(f"| {card} | {f['host_link_gbps']:.0f} | {f['cpu_adam_gparams']:.2f} | {how} | {steps} |")
        lines.append(
            f"| {card} | {f['host_link_gbps']:.0f} | {per_precision} | the CPU Adam rate per "
            f"--adam-state-precision, the host link as above (the planner prices one rate for all) | |"
        )
        for r in rows:
            p = r.get("profile")
            if r["card"] == card and p:
                lines.append(
                    f"| {card} | {cell(p['host_link_gbps'])} | {cell(p['cpu_adam_gparams'])} | "
                    f"{r['figure']}'s profile (bytes / copy time, parameters / CPU Adam time) | |"
                )
    return "\n".join(lines)


def calibrate(paths: List[str], vocab_size: int) -> Tuple[List[Dict[str, Any]], Dict[str, Dict[str, Any]]]:
    lines = read_lines(paths)
    rows = [layout_row(path, line, vocab_size) for path, line in lines if is_offload_figure(line)]
    rows = [r for r in rows if r["optimizer"] == "cpu_adam"]  # what the CPU Adam term prices
    if not rows:
        raise SystemExit(f"plan_calibration: error: no finished cpu_adam offload figure in {' '.join(paths)}")
    for _, line in lines:
        profile = profile_result(line)
        match = [r for r in rows if profile and r["plan"].stats.arch == profile["arch"]]
        if match:
            add_profile(match[-1], profile)
    fits = {}
    for card in dict.fromkeys(r["card"] for r in rows):
        layouts = [r for r in rows if r["card"] == card]
        fits[card] = {**fit(layouts), "layouts": len(layouts)}
        precisions = dict.fromkeys(r["adam_state_precision"] for r in layouts)
        fits[card]["cpu_adam_gparams_by_precision"] = {
            p: fit_adam_rate([r for r in layouts if r["adam_state_precision"] == p], fits[card]["host_link_gbps"])
            for p in precisions
        }
    return rows, fits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("figures", nargs="+", help="gpu_figures JSON-lines files (benchmarks.figure's lines)")
    ap.add_argument(
        "--vocab-size",
        type=int,
        default=12448,
        help="the dictionary's size when a figure's data-bin is not here (12448: gpu.sh prepare's wikitext-2-mini)",
    )
    ap.add_argument("--out", default=None, help="also write the tables (markdown) to this file")
    add_results_flag(ap)
    args = ap.parse_args(argv)
    report = Report("plan_calibration", argv=argv)
    missing = [p for p in args.figures if not os.path.isfile(p)]
    if missing:
        ap.error(f"no such figures file: {', '.join(missing)}")
    rows, fits = calibrate(args.figures, args.vocab_size)
    text = markdown(rows, fits)
    print(text)
    if args.out:
        write_text(args.out, text)
    layouts = [
        {
            **{k: v for k, v in r.items() if k not in ("plan", "terms")},
            "terms": {t: {"plan": p, "measured": m} for t, (p, m) in r["terms"].items()},
        }
        for r in rows
    ]
    report.emit(results=args.results, layouts=layouts, fits=fits)
    return 0


if __name__ == "__main__":
    sys.exit(main())
