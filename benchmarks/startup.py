"""Command start-up time: what every command, every spawned rank and every integration test pays
before it does anything.

    python -m benchmarks.startup                          # this checkout, 7 fresh interpreters per command
    python -m benchmarks.startup --runs 11 --baseline /tmp/main-checkout   # before/after, alternated
    python -m benchmarks.startup --runs 5 --only help     # just the cases whose name contains "help"

For each command (train, eval_lm, generate, export) it times ``import toolkit_cli.<cmd>`` in a fresh
interpreter, and ``toolkit-<cmd> --help`` (``python -m toolkit_cli.<cmd> --help``, the whole parse) of
train, export, plan, hydra-train, eval-harness and consolidate;
``import torch`` alone is the floor of a command that runs (``--help`` and argument errors exit before torch
is imported: tests/integration/test_startup.py). Reports the median wall time of ``--runs``
interpreters, the optional packages each import pulled in (DCP, dynamo, DeepSpeed, transformers, ...
should appear only on the paths that use them), and the load average before and after, since the
figures move with the machine's load. With ``--baseline DIR`` (another checkout, e.g. ``git archive
main | tar -x -C DIR``) each round runs both trees back to back (:func:`benchmarks.timing.alternate`), so they
see the same load.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Dict, List

from benchmarks.timing import REPO, Report, Stats, add_results_flag, alternate

COMMANDS = ("train", "eval_lm", "generate", "export")
HELP_COMMANDS = ("train", "export", "plan", "hydra_train", "eval_harness", "consolidate")
# What no command's start-up may import: each comes in on the paths that use it (tests/integration/test_startup.py
# asserts it command by command).
LAZY = (
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "torch._dynamo",
    "torch._inductor",
    "torch.distributed.fsdp",
    "deepspeed",
    "transformers",
    "safetensors",
    "onnx",
    "onnxruntime",
    "onnxscript",
    "tensorboard",
    "wandb",
    "lm_eval",
    "datasets",
    "omegaconf",
    "hydra",
)
# The modules each case reports: the lazy ones, and those start-up may import whose cost is worth seeing.
HEAVY = LAZY + ("sympy", "sentencepiece", "tokenizers")
REPORT = "import sys, json; print(json.dumps([m for m in {heavy!r} if m in sys.modules]))"


def cases() -> Dict[str, List[str]]:
    """name -> the python arguments of one fresh interpreter."""
    out = {"import torch": ["-c", "import torch"]}
    for cmd in COMMANDS:
        out[f"import toolkit_cli.{cmd}"] = ["-c", f"import toolkit_cli.{cmd}"]
    for cmd in HELP_COMMANDS:
        out[f"toolkit-{cmd.replace('_', '-')} --help"] = ["-m", f"toolkit_cli.{cmd}", "--help"]
    return out


def run_once(tree: str, args: List[str]) -> None:
    env = {**os.environ, "PYTHONPATH": tree}
    subprocess.run(
        [sys.executable, *args], cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def heavy_modules(tree: str, cmd: str) -> List[str]:
    code = f"import toolkit_cli.{cmd}; " + REPORT.format(heavy=HEAVY)
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": tree},
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(trees: Dict[str, str], runs: int, chosen: Dict[str, List[str]]) -> Dict[str, Stats]:
    """Seconds per "tree: case"; every round runs each case in each tree, the trees back to back."""
    runs_of = {
        f"{name}: {case}": lambda tree=tree, args=args: run_once(tree, args)
        for case, args in chosen.items()
        for name, tree in trees.items()
    }
    return alternate(runs_of, runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="fresh interpreters per case and tree")
    parser.add_argument("--baseline", help="another checkout to time in the same rounds (before/after)")
    parser.add_argument("--only", default="", help="time only the cases whose name contains this (e.g. help)")
    add_results_flag(parser)
    args = parser.parse_args()
    report = Report("startup")
    chosen = {name: argv for name, argv in cases().items() if args.only in name}
    trees = {"this": str(REPO)}
    if args.baseline:
        trees = {"baseline": os.path.abspath(args.baseline), "this": str(REPO)}
    load_before = os.getloadavg()
    stats = measure(trees, args.runs, chosen)
    medians = {t: {c: stats[f"{t}: {c}"].median for c in chosen} for t in trees}
    load_after = os.getloadavg()
    heavy = {t: {cmd: heavy_modules(tree, cmd) for cmd in COMMANDS} for t, tree in trees.items()}
    bytecode = (
        "off (PYTHONDONTWRITEBYTECODE: every start compiles the sources)"
        if os.environ.get("PYTHONDONTWRITEBYTECODE")
        else "on"
    )
    print(
        f"median of {args.runs} fresh interpreters; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after; {os.cpu_count()} CPUs; bytecode cache {bytecode}"
    )
    print(f"{'case':30s}" + "".join(f"{t:>12s}" for t in trees))
    for case in chosen:
        print(f"{case:30s}" + "".join(f"{medians[t][case]:11.2f}s" for t in trees))
    for t in trees:
        for cmd in COMMANDS:
            print(f"{t}: toolkit_cli.{cmd} imports {', '.join(heavy[t][cmd]) or 'none of the optional/heavy modules'}")
    report.emit(stats, results=args.results, runs=args.runs, median_s=medians, heavy_modules=heavy)


if __name__ == "__main__":
    main()
