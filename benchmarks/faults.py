"""Crash consistency: training runs killed with SIGKILL at random moments resume bit-identical.

    python -m benchmarks.faults --runs 20            # the figure reported for issue 10
    python -m benchmarks.faults --runs 3 --updates 6 # the short version tests/integration/test_faults.py runs
    python -m benchmarks.faults --runs 6 --updates 6 --expert-parallel-size 2  # the MoE family, experts on 2 ranks
    python -m benchmarks.faults --runs 2 --arch deepseek_v3_tiny --model-flags="--mtp-depth 1"  # another family

One uninterrupted reference run first. Then ``--runs`` runs of the same command, each
``kill -9``ed once: at least half of them right after a checkpoint's temporary file
appears in ``--save-dir`` (``--save-interval-updates 1``, so every update saves; a busy
poll of the folder catches the write in progress), the others a random few milliseconds
after a random update. Each killed run is resumed once with the same command (it runs to
the end), then restarted once more (a finished run: the restart must change nothing; the
last ``--finished-restarts`` runs, default all).

Then the new kinds (issue 19): ``--signal-runs`` runs stopped by SIGINT or SIGTERM the moment
a save's temporary file appears (consolidated and ``--use-sharded-state`` in turn), each
resumed to the end; and ``--writer-runs`` runs during which a second ``toolkit-train`` (another
seed) is started on the same ``--save-dir``: it must stop at once with one line naming the
first run's pid, and the first run must finish as the reference did.

A run *matches* when every update's logged loss (the killed run's, overridden by the
resumed run's for the updates it redid) equals the reference's, the final
``checkpoint_last.pt`` holds the reference's exact weights, and the restart of the
finished run left every file byte-identical. Prints one line per run, ``matched/total`` and one JSON line
(``"benchmark": "faults"``).

The runs start with ``$TOOLKIT_PY`` where it is set (as in benchmarks/gpu.sh; tests/integration/test_faults.py
points it at tests/helpers/fork_python.py, which forks each run from a process that has imported torch once).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from benchmarks.timing import Report, add_results_flag, now

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TMP_NAME = re.compile(r"\..*\.tmp")  # atomic_write's and sharded saves' temporary names
LOSS_LINE = re.compile(r"\| train_inner \| (\{.*\})\s*$")
MODEL = [
    "--task",
    "language_modeling",
    "--arch",
    "transformer_lm",
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "128",
    "--decoder-ffn-embed-dim",
    "512",
    "--decoder-attention-heads",
    "4",
    "--decoder-input-dim",
    "128",
    "--decoder-output-dim",
    "128",
    "--decoder-normalize-before",
    "--dropout",
    "0",
    "--optimizer",
    "adam",
    "--lr",
    "0.001",
    "--lr-scheduler",
    "inverse_sqrt",
    "--warmup-updates",
    "4",
    "--batch-size",
    "4",
    "--tokens-per-sample",
    "32",
    "--seed",
    "7",
    "--num-workers",
    "0",
    "--cpu",
    "--log-format",
    "json",
    "--log-interval",
    "1",
    "--disable-validation",
    "--save-interval-updates",
    "1",
    "--keep-interval-updates",
    "2",
]


def expert_parallel_model(ep: int) -> List[str]:
    """``--expert-parallel-size EP``: the MoE family's tiny model (4 experts) with its experts over EP ranks (as
    many as the world), the same optimizer, schedule and saves as ``MODEL``; rank 0 saves the gathered stacks."""
    return model_of("moe_tiny", ["--distributed-world-size", str(ep), "--expert-parallel-size", str(ep)])


def model_of(arch: str, flags: Sequence[str]) -> List[str]:
    """``MODEL`` with another architecture (its named size's shapes) and ``flags``: the same optimizer, schedule
    and saves."""
    return ["--task", "language_modeling", "--arch", arch, *flags] + MODEL[MODEL.index("--optimizer") :]


def make_data_bin(dest: str, lines: int = 600, seed: int = 0) -> str:
    """A deterministic data-bin of random sentences over a 200-word vocabulary."""
    from toolkit.data.dictionary import Dictionary
    from toolkit.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype

    rng = random.Random(seed)
    words = [f"w{i}" for i in range(200)]
    text = {
        split: [" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(n)]
        for split, n in (("train", lines), ("valid", 20))
    }
    d = Dictionary()
    d.add_counts(Dictionary.count_words(text["train"]))
    d.finalize()
    os.makedirs(dest, exist_ok=True)
    d.save(os.path.join(dest, "dict.txt"))
    for split, split_lines in text.items():
        builder = MMapIndexedDatasetBuilder(os.path.join(dest, f"{split}.bin"), dtype=best_fitting_dtype(len(d)))
        for line in split_lines:
            builder.add_item(d.encode_line(line))
        builder.finalize(os.path.join(dest, f"{split}.idx"))
    return dest


def command(data_bin: str, save_dir: str, updates: int) -> List[str]:
    return [
        *python(),
        "-m",
        "toolkit_cli.train",
        data_bin,
        "--save-dir",
        save_dir,
        *MODEL,
        "--max-update",
        str(updates),
    ]


def environment() -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def python() -> List[str]:
    """The interpreter of the runs: ``$TOOLKIT_PY`` (as in benchmarks/gpu.sh), else this one."""
    return shlex.split(os.environ["TOOLKIT_PY"]) if os.environ.get("TOOLKIT_PY") else [sys.executable]


class Run:
    """A started run: its status from the process started, its signals to the process that trains.

    The two differ when ``$TOOLKIT_PY`` runs the command in another process (tests/helpers/fork_python.py forks it
    from a server that has imported torch): such an interpreter writes that process's pid into
    ``$TOOLKIT_PY_PID_FILE``, so a SIGKILL or SIGSTOP reaches the training itself, and ``pid`` is the one that
    takes the save dir's lock."""

    def __init__(self, cmd: List[str], log: str):
        self.pid_file = f"{log}.pid" if os.environ.get("TOOLKIT_PY") else None
        env = environment()
        if self.pid_file:
            env["TOOLKIT_PY_PID_FILE"] = self.pid_file
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.pid_file)
        with open(log, "w") as out:
            self.started = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        self._pid = None if self.pid_file else self.started.pid

    @property
    def pid(self) -> int:
        while self._pid is None:
            with contextlib.suppress(FileNotFoundError, ValueError):
                with open(self.pid_file) as f:
                    self._pid = int(f.read())
            if self._pid is None and self.started.poll() is not None:  # ended before it said
                self._pid = self.started.pid
            time.sleep(0.001)
        return self._pid

    def poll(self) -> Optional[int]:
        return self.started.poll()

    @property
    def returncode(self) -> Optional[int]:
        """The started process's status once it has ended (as ``subprocess.Popen.returncode``)."""
        return self.started.returncode

    def wait(self) -> int:
        return self.started.wait()

    def send_signal(self, sig: int) -> None:
        """``sig`` to the training process while the run has not ended (never to a pid reused since)."""
        pid = self.pid
        if self.started.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


def start(cmd: List[str], log: str) -> Run:
    return Run(cmd, log)


def losses(log: str) -> Dict[int, str]:
    """{update: logged loss} (as printed: exact comparison); a line cut by the kill is skipped."""
    out = {}
    with open(log, errors="replace") as f:
        for line in f:
            m = LOSS_LINE.search(line)
            if m:
                try:
                    stats = json.loads(m.group(1))
                except json.JSONDecodeError:
                    continue
                out[int(stats["num_updates"])] = stats["loss"]
    return out


def last_update(log: str) -> int:
    return max(losses(log), default=0)


def snapshot(folder: str) -> Dict[str, str]:
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


def temp_files(save_dir: str) -> List[str]:
    try:
        return [n for n in os.listdir(save_dir) if TMP_NAME.fullmatch(n)]
    except FileNotFoundError:
        return []


def wait_for_update(proc: Run, log: str, update: int, timeout: float = 600) -> bool:
    deadline = now() + timeout
    while proc.poll() is None and now() < deadline:
        if last_update(log) >= update:
            return True
        time.sleep(0.01)
    return False


def workers(pid: int) -> List[int]:
    """The processes ``pid`` started (a launcher's ranks), from Linux's /proc; [] elsewhere or once it is gone."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill9(proc: Run, timeout: float = 30) -> None:
    """SIGKILL ``proc``, then wait until the ranks it launched are gone too (they stop when their launcher dies;
    one still running would hold the save dir's writer lock against the resume): SIGKILLed after ``timeout``."""
    ranks = workers(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = now() + timeout
    while any(running(pid) for pid in ranks) and now() < deadline:
        time.sleep(0.05)
    for pid in (pid for pid in ranks if running(pid)):
        os.kill(pid, signal.SIGKILL)


def kill_during_save(proc: Run, save_dir: str) -> bool:
    """SIGKILL the moment a checkpoint temp file shows up (busy poll); False if the run ended first."""
    while proc.poll() is None:
        if temp_files(save_dir):
            kill9(proc)
            return True
    return False


def kill_once(
    cmd: List[str], save_dir: str, log: str, rng: random.Random, during_save: bool, updates: int
) -> Tuple[str, int]:
    """Start the run and kill it once; returns (where it was killed, last logged update)."""
    proc = start(cmd, log)
    wait_for_update(proc, log, rng.randint(1, max(1, updates - 2)))
    if during_save:
        killed = kill_during_save(proc, save_dir)
    else:
        time.sleep(rng.uniform(0.0, 0.05))
        killed = proc.poll() is None
        kill9(proc)
    where = "after the end" if not killed else ("during a save" if temp_files(save_dir) else "between saves")
    return where, last_update(log)


def final_weights(save_dir: str) -> Dict[str, torch.Tensor]:
    return torch.load(os.path.join(save_dir, "checkpoint_last.pt"), map_location="cpu", weights_only=True)["model"]


def same_weights(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def restart_is_no_op(cmd: List[str], save_dir: str, log: str) -> bool:
    """Run the finished run's command again: it must exit 0, say it is done, and change no file."""
    before = snapshot(save_dir)
    ok = start(cmd, log).wait() == 0 and snapshot(save_dir) == before
    with open(log, errors="replace") as f:
        return ok and "| done: " in f.read()


def one_run(index: int, args, data_bin: str, reference: dict, rng: random.Random) -> Tuple[bool, str]:
    save_dir = os.path.join(args.workdir, f"run{index}")
    cmd = command(data_bin, save_dir, args.updates)
    during_save = index % 2 == 0 or rng.random() < 0.25  # at least half
    where, killed_at = kill_once(
        cmd, save_dir, os.path.join(args.workdir, f"run{index}.kill.log"), rng, during_save, args.updates
    )
    merged = losses(os.path.join(args.workdir, f"run{index}.kill.log"))
    resume_log = os.path.join(args.workdir, f"run{index}.resume.log")
    resumed = start(cmd, resume_log)
    if resumed.wait() != 0:
        return False, f"{where} at update {killed_at}; resume failed (see {resume_log})"
    merged.update(losses(resume_log))
    tried = index >= args.runs - args.finished_restarts
    restarted_ok = not tried or restart_is_no_op(cmd, save_dir, os.path.join(args.workdir, f"run{index}.restart.log"))
    losses_ok = merged == reference["losses"]
    weights_ok = same_weights(final_weights(save_dir), reference["weights"])
    detail = (
        f"killed {where} (update {killed_at}); losses {'=' if losses_ok else '!='} reference, weights "
        f"{'=' if weights_ok else '!='} reference, finished restart "
        f"{'not tried' if not tried else 'no-op' if restarted_ok else 'CHANGED FILES'}"
    )
    if losses_ok and weights_ok and restarted_ok:
        shutil.rmtree(save_dir, ignore_errors=True)
    return losses_ok and weights_ok and restarted_ok, detail


def final_weights_any(save_dir: str) -> Dict[str, torch.Tensor]:
    """checkpoint_last's model, consolidated (.pt) or sharded (DCP folder)."""
    folder = os.path.join(save_dir, "checkpoint_last")
    if os.path.isdir(folder):
        from toolkit.checkpoint.safe_pickle import dcp_to_state_dict

        return dcp_to_state_dict(folder)["model"]
    return final_weights(save_dir)


def signal_run(index: int, args, data_bin: str, reference: dict) -> Tuple[bool, str]:
    """SIGINT/SIGTERM the moment a save's temporary file appears; the resume must finish as the reference."""
    sig = (signal.SIGINT, signal.SIGTERM)[index % 2]
    sharded = ["--use-sharded-state"] if (index // 2 + index) % 2 and not args.expert_parallel_size > 1 else []
    # both formats within 2 runs; expert parallelism saves consolidated checkpoints only
    save_dir = os.path.join(args.workdir, f"signal{index}")
    cmd = command(data_bin, save_dir, args.updates) + sharded
    log = os.path.join(args.workdir, f"signal{index}.log")
    proc = start(cmd, log)
    wait_for_update(proc, log, 1 + index % max(1, args.updates - 2))
    while proc.poll() is None and not temp_files(save_dir):
        pass
    caught = proc.poll() is None
    if caught:
        proc.send_signal(sig)
    code = proc.wait()
    merged = losses(log)
    resume_log = os.path.join(args.workdir, f"signal{index}.resume.log")
    if start(cmd, resume_log).wait() != 0:
        return False, f"{sig.name} (exit {code}); resume failed (see {resume_log})"
    merged.update(losses(resume_log))
    ok = merged == reference["losses"] and same_weights(final_weights_any(save_dir), reference["weights"])
    if ok:
        shutil.rmtree(save_dir, ignore_errors=True)
    return ok, (
        f"{sig.name} {'during a save' if caught else 'after the end'} ({'sharded' if sharded else 'consolidated'}"
        f", exit {code}); losses and weights {'=' if ok else '!='} reference"
    )


def writers_run(index: int, args, data_bin: str, reference: dict) -> Tuple[bool, str]:
    """A second run on the same --save-dir while the first trains: refused, the first unharmed."""
    sharded = ["--use-sharded-state"] if index % 2 and not args.expert_parallel_size > 1 else []
    save_dir = os.path.join(args.workdir, f"writers{index}")
    cmd = command(data_bin, save_dir, args.updates) + sharded
    log, second_log = (os.path.join(args.workdir, f"writers{index}.{n}.log") for n in ("first", "second"))
    first = start(cmd, log)
    lock = os.path.join(save_dir, ".toolkit.lock")
    while first.poll() is None and not os.path.exists(lock):
        time.sleep(0.005)
    first.send_signal(signal.SIGSTOP)  # holds the lock (and is mid-run) for as long as the second one takes
    other = [a if a != "7" else "99" for a in cmd]  # --seed 99
    try:
        code = start(other, second_log).wait()
    finally:
        first.send_signal(signal.SIGCONT)
    first_code = first.wait()
    with open(second_log, errors="replace") as f:
        said = f.read()
    named = f"in use by toolkit-train (pid {first.pid} on host " in said and "Traceback" not in said
    unharmed = first_code == 0 and losses(log) == reference["losses"]
    unharmed = unharmed and same_weights(final_weights_any(save_dir), reference["weights"])
    ok = code == 1 and named and unharmed
    if ok:
        shutil.rmtree(save_dir, ignore_errors=True)
    return ok, (  # each verdict apart: a refusal that names nobody is not a first run that differs
        f"second writer exit {code} ({'named the holder' if named else 'DID NOT NAME THE HOLDER'}), first "
        f"run exit {first_code} ({'sharded' if sharded else 'consolidated'}); first run's losses and weights "
        f"{'=' if unharmed else '!='} reference"
    )


def run_kind(name: str, runs: int, fn, *fn_args) -> int:
    matched = 0
    for i in range(runs):
        ok, detail = fn(i, *fn_args)
        matched += ok
        print(f"{name} {i + 1}/{runs}: {'match' if ok else 'MISMATCH'}: {detail}", flush=True)
    print(f"{name} matched: {matched}/{runs}")
    return runs - matched


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="killed runs")
    p.add_argument("--updates", type=int, default=12, help="--max-update of every run")
    p.add_argument(
        "--finished-restarts",
        type=int,
        default=None,
        help="how many runs (the last ones) are restarted once more after they finished (default: all)",
    )
    p.add_argument(
        "--signal-runs",
        type=int,
        default=4,
        help="runs stopped by SIGINT/SIGTERM in mid-save (consolidated and sharded in turn)",
    )
    p.add_argument("--writer-runs", type=int, default=2, help="runs with a second writer on their --save-dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="folder for data, checkpoints and logs (default: a temp dir)")
    p.add_argument(
        "--expert-parallel-size",
        type=int,
        default=1,
        help="> 1: the MoE family with its experts over this many ranks (the launcher is killed)",
    )
    p.add_argument("--arch", default=None, help="another architecture than the small transformer_lm (one process)")
    p.add_argument("--model-flags", default="", help="with --arch: its own flags, one string (e.g. '--mtp-depth 1')")
    add_results_flag(p)
    args = p.parse_args(argv)
    report = Report("faults", argv=argv)
    if args.expert_parallel_size > 1:
        MODEL[:] = expert_parallel_model(args.expert_parallel_size)  # what command() runs, for every kind of run
    elif args.arch is not None:
        MODEL[:] = model_of(args.arch, args.model_flags.split())
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="faults.")
    args.finished_restarts = args.runs if args.finished_restarts is None else args.finished_restarts
    rng = random.Random(args.seed)
    data_bin = make_data_bin(os.path.join(args.workdir, "bin"))
    ref_dir, ref_log = os.path.join(args.workdir, "reference"), os.path.join(args.workdir, "reference.log")
    if start(command(data_bin, ref_dir, args.updates), ref_log).wait() != 0:
        print(f"reference run failed; see {ref_log}")
        return 2
    reference = {"losses": losses(ref_log), "weights": final_weights(ref_dir)}
    print(f"reference: {args.updates} updates, final loss {reference['losses'][args.updates]}", flush=True)
    matched, during_save = 0, 0
    for i in range(args.runs):
        ok, detail = one_run(i, args, data_bin, reference, rng)
        matched += ok
        during_save += "during a save" in detail
        print(f"run {i + 1}/{args.runs}: {'match' if ok else 'MISMATCH'}: {detail}", flush=True)
    print(f"kills during a save (a temporary file was left behind): {during_save}/{args.runs}")
    print(f"matched: {matched}/{args.runs}")
    failed = run_kind("signal in mid-save", args.signal_runs, signal_run, args, data_bin, reference)
    failed += run_kind("two writers", args.writer_runs, writers_run, args, data_bin, reference)
    report.emit(
        results=args.results,
        runs=args.runs,
        matched=matched,
        kills_during_save=during_save,
        other_runs_failed=failed,
        expert_parallel_size=args.expert_parallel_size,
    )
    return 0 if matched == args.runs and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
