"""Where a tiny ``toolkit-train`` run spends the time between its start and its first update.

    python -m benchmarks.first_update                       # this checkout, 3 fresh runs
    python -m benchmarks.first_update --runs 5 --baseline /tmp/main-checkout   # before/after, alternated

A 2-layer, width-32 ``transformer_lm`` on CPU (a data-bin made once with toolkit-preprocess from the head of
``../shared/data/wikitext-2-mini``), ``--max-update 1 --no-save``. Each run is a fresh interpreter whose
``toolkit.train.train_loop`` functions are wrapped with timers, so the phases are the run's own calls:
imports + parse + resolve (everything before ``train()``), process group and log setup, the task and
model (``build_trainer``: data, model on meta + init, optimizer), the CPU peak measured for MFU
(``throughput_spec``), the checkpoint look-up and the batch iterator, and the first ``train_step``.
Each phase is reported as wall and CPU seconds (median over ``--runs``, the trees alternated run by run:
:func:`benchmarks.timing.alternate`): on a shared machine the CPU seconds move less with the load. Also lists the optional/heavy modules loaded at the first update.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List

from benchmarks.timing import REPO, Report, add_results_flag, alternate, median, time_call

CORPUS = os.path.join(REPO, "..", "shared", "data", "wikitext-2-mini")
HEAVY = (
    "torch._dynamo",
    "torch._inductor",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "sympy",
    "deepspeed",
    "transformers",
    "tensorboard",
    "wandb",
    "lm_eval",
)
PHASES = (
    "init_distributed",
    "setup_logging",
    "check_outputs",
    "build_trainer",
    "throughput_spec",
    "load_latest",
    "train_iterator",
)

# Runs in the fresh interpreter: wraps the phases, stops the process at the end of the first update. It reads
# the clocks itself, before any import it would time, and runs in --baseline's tree too, which may hold no
# benchmarks.timing; the rounds and medians around it are timing's.
PROBE = """
import json, os, sys, time
t0, c0 = time.perf_counter(), time.process_time()
marks = []
def mark(name):
    marks.append((name, time.perf_counter() - t0, time.process_time() - c0))
import runpy
from toolkit.train import train_loop
from toolkit.train.trainer import Trainer
def timed(name, fn):
    def inner(*args, **kwargs):
        mark("before " + name)
        try:
            return fn(*args, **kwargs)
        finally:
            mark(name)
    return inner
for name in {phases!r}:
    target = train_loop.manager if name == "load_latest" else train_loop
    setattr(target, name, timed(name, getattr(target, name)))
first_step = Trainer.train_step
def train_step(self, samples):
    mark("before train_step")
    out = first_step(self, samples)
    mark("train_step")
    heavy = sorted(m for m in {heavy!r} if m in sys.modules)
    print("PROBE " + json.dumps({{"marks": marks, "heavy": heavy}}), file=sys.stderr, flush=True)
    os._exit(0)
Trainer.train_step = train_step
sys.argv = ["toolkit-train"] + {argv!r}
runpy.run_module("toolkit_cli.train", run_name="__main__")
"""


def make_data_bin(folder: str) -> str:
    """A small data-bin (the head of wikitext-2-mini) made with this checkout's toolkit-preprocess."""
    for split in ("train", "valid"):
        with open(os.path.join(CORPUS, f"wiki.{split}.tokens"), encoding="utf-8") as f:
            text = f.read(200_000 if split == "train" else 20_000)
        with open(os.path.join(folder, f"{split}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
    dest = os.path.join(folder, "data-bin")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "toolkit_cli.preprocess",
            "--only-source",
            "--trainpref",
            os.path.join(folder, "train.txt"),
            "--validpref",
            os.path.join(folder, "valid.txt"),
            "--destdir",
            dest,
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return dest


def train_argv(data: str, save_dir: str) -> List[str]:
    return [
        data,
        "--arch",
        "transformer_lm",
        "--decoder-layers",
        "2",
        "--decoder-embed-dim",
        "32",
        "--decoder-input-dim",
        "32",
        "--decoder-output-dim",
        "32",
        "--decoder-ffn-embed-dim",
        "64",
        "--decoder-attention-heads",
        "2",
        "--tokens-per-sample",
        "32",
        "--batch-size",
        "2",
        "--max-update",
        "1",
        "--optimizer",
        "adam",
        "--lr",
        "0.001",
        "--cpu",
        "--log-format",
        "simple",
        "--no-save",
        "--disable-validation",
        "--num-workers",
        "0",
        "--save-dir",
        save_dir,
    ]


def run_once(tree: str, argv: List[str]) -> Dict:
    """{phase: (wall s, cpu s)} of one fresh run, plus its total wall time and the heavy modules it loaded."""
    code = PROBE.format(phases=PHASES, heavy=HEAVY, argv=argv)
    total, run = time_call(
        lambda: subprocess.run(
            [sys.executable, "-c", code],
            cwd=tree,
            env={**os.environ, "PYTHONPATH": tree},
            capture_output=True,
            text=True,
            timeout=900,
        )
    )
    probe = [line for line in run.stderr.splitlines() if line.startswith("PROBE ")]
    if not probe:
        raise SystemExit(f"{tree}: the run ended before its first update:\n{run.stderr[-3000:]}")
    found = json.loads(probe[-1][len("PROBE ") :])
    phases, previous = {}, (0.0, 0.0)
    for name, wall, cpu in found["marks"]:
        key = "imports + parse + resolve" if name == "before init_distributed" else name
        if not name.startswith("before ") or key != name:
            phases[key] = (wall - previous[0], cpu - previous[1])
        previous = (wall, cpu)
    phases["to the first update (in process)"] = tuple(previous)
    phases["to the first update (whole process)"] = (total, float("nan"))
    return {"phases": phases, "heavy": found["heavy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh runs per tree")
    parser.add_argument("--baseline", help="another checkout to time in the same rounds (before/after)")
    add_results_flag(parser)
    args = parser.parse_args()
    report = Report("first_update")
    trees = {"this": str(REPO)}
    if args.baseline:
        trees = {"baseline": os.path.abspath(args.baseline), "this": str(REPO)}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        argv = train_argv(make_data_bin(tmp), os.path.join(tmp, "checkpoints"))
        results: Dict[str, List[Dict]] = {t: [] for t in trees}
        runs = {
            name: lambda name=name, tree=tree: results[name].append(run_once(tree, argv))
            for name, tree in trees.items()
        }
        stats = alternate(runs, args.runs)
    load_after = os.getloadavg()
    names = list(results[next(iter(trees))][0]["phases"])
    medians = {
        t: {p: [median([r["phases"][p][i] for r in rs]) for i in (0, 1)] for p in names} for t, rs in results.items()
    }
    print(
        f"median of {args.runs} runs; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
        f"{os.cpu_count()} CPUs; seconds as wall / CPU"
    )
    print(f"{'phase':38s}" + "".join(f"{t:>20s}" for t in trees))
    for p in names:
        print(f"{p:38s}" + "".join(f"{medians[t][p][0]:11.2f} / {medians[t][p][1]:5.2f}" for t in trees))
    for t, rs in results.items():
        print(f"{t}: loaded at the first update: {', '.join(rs[-1]['heavy']) or 'none of the heavy modules'}")
    report.emit(
        stats,
        results=args.results,
        runs=args.runs,
        median_wall_cpu_s=medians,
        heavy={t: rs[-1]["heavy"] for t, rs in results.items()},
    )


if __name__ == "__main__":
    main()
