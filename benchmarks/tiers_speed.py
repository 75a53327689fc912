"""What the integration tier's fork server saves: one short ``toolkit-train`` run, forked vs a fresh interpreter.

    python -m benchmarks.tiers_speed                 # 5 runs each, 3 updates, 1 process
    python -m benchmarks.tiers_speed --runs 9 --world-size 2

Every integration test that starts a command goes through ``tests.helpers.cli.run_cli``; for ``toolkit_cli``
modules it forks the command from a server that imported the toolkit once (tests/helpers/forkserver.py),
unless ``TOOLKIT_TESTS_FORK=0``, where each command starts a fresh ``python -m``. This times the same call,
``tests.helpers.cli.run_train`` on the suite's tiny model (3 updates, no checkpoint), both ways: the runs
alternate between the two modes (:func:`benchmarks.timing.alternate`: a load change on a shared machine hits
both alike), each run's wall time
is taken around the call, and the table gives the median, min and max of ``--runs`` runs per mode. The first
forked call, which also starts the server (its imports), is timed apart and left out of the median.
A table is printed, then one JSON line.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Dict

from benchmarks.timing import Report, add_results_flag, alternate, time_call
from tests.helpers import cli
from tests.helpers.dist_helpers import make_lm_data_bin, model_args

MODES = {"fork": "1", "fresh": "0"}


def one_run(mode: str, data: str, save: str, updates: int, world_size: int) -> None:
    """One ``run_train`` call in ``mode``; a failed run stops the benchmark with its stderr."""
    os.environ["TOOLKIT_TESTS_FORK"] = MODES[mode]  # read by run_cli at each call
    argv = [data, *model_args(save), "--max-update", str(updates), "--no-save", "--disable-validation"]
    if world_size > 1:
        argv += ["--distributed-world-size", str(world_size)]
    run = cli.run_train(argv)
    if run.returncode != 0:
        sys.exit(f"tiers_speed: the {mode} run failed (exit {run.returncode}): {run.stderr.strip()[-1500:]}")
    if len(run.losses()) != updates:
        sys.exit(f"tiers_speed: the {mode} run logged {sorted(run.losses())}, not {updates} updates")


def measure(runs: int, updates: int, world_size: int) -> Dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="tiers-speed-") as tmp:
        data = make_lm_data_bin(os.path.join(tmp, "bin"))
        save = os.path.join(tmp, "save")
        # the first forked run also starts the server: timed apart
        first_fork, _ = time_call(lambda: one_run("fork", data, save, updates, world_size))
        forks = cli._fork_ok()  # False on a machine with an NVIDIA driver (TOOLKIT_TESTS_FORK=1 set just now)
        stats = alternate(
            {mode: lambda mode=mode: one_run(mode, data, save, updates, world_size) for mode in MODES}, runs
        )
    return {"first_fork_s": first_fork, "stats": stats, "forks": forks}


def summarize(result: Dict[str, object], args: argparse.Namespace, report: Report) -> None:
    stats = result["stats"]
    median = {mode: st.median for mode, st in stats.items()}
    print(
        f"toolkit-train, {args.updates} updates, {args.world_size} process(es), {args.runs} runs per mode "
        f"(tests.helpers.cli.run_train)"
    )
    print(f"{'mode':<28} {'median s':>9} {'min s':>7} {'max s':>7}")
    for mode, label in (("fresh", "fresh interpreter (FORK=0)"), ("fork", "forked from server (FORK=1)")):
        print(f"{label:<28} {median[mode]:>9.2f} {stats[mode].min:>7.2f} {stats[mode].max:>7.2f}")
    print(f"{'first forked run (+server)':<28} {result['first_fork_s']:>9.2f}")
    saved = median["fresh"] - median["fork"]
    print(f"saved per command: {saved:.2f} s (fresh / fork = {median['fresh'] / median['fork']:.2f}x)")
    if not result["forks"]:
        print("note: this machine has an NVIDIA driver, so run_cli never forks: both modes are fresh interpreters")
    report.emit(
        stats,
        "fresh",
        args.results,
        updates=args.updates,
        world_size=args.world_size,
        runs=args.runs,
        median_s={m: round(v, 3) for m, v in median.items()},
        first_fork_s=round(result["first_fork_s"], 3),
        forks=result["forks"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs per mode (median reported)")
    parser.add_argument("--updates", type=int, default=3, help="--max-update of each run")
    parser.add_argument("--world-size", type=int, default=1, help="--distributed-world-size of each run")
    add_results_flag(parser)
    args = parser.parse_args()
    report = Report("tiers_speed")
    if args.runs < 1 or args.updates < 1 or args.world_size < 1:
        parser.error("--runs, --updates and --world-size must be at least 1")
    summarize(measure(args.runs, args.updates, args.world_size), args, report)


if __name__ == "__main__":
    main()
