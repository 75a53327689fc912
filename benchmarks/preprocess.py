"""Throughput and peak memory of ``toolkit-preprocess`` (whitespace tokens) on a corpus of >= 200 MB.

    python -m benchmarks.preprocess                      # 200 MB, 1 and 2 workers
    python -m benchmarks.preprocess --size-mb 500 --workers 1 2 4

The corpus is the shared WikiText train file repeated into a temporary folder
(never the repo). Each configuration runs as its own ``python -m
toolkit_cli.preprocess`` process, twice:

* ``pipeline``: ``--trainpref`` only: dictionary + binarize of the train split
  (one pass with provisional ids, then renumbering; see toolkit/data/binarizer.py);
* ``binarize``: ``--srcdict`` (the dictionary from the first run) + ``--validpref``
  on the same corpus: binarizing with a known dictionary.

Reported: tokens/s of the work itself (from the tool's log, so without the ~2 s
of Python/torch start-up), tokens/s per worker, tokens per CPU-second of the
whole process tree minus the start-up CPU (robust when the machine is shared),
and peak memory of the whole process tree: the sum
of RSS over parent + workers (an upper bound: forked workers share pages with
the parent), the sum of PSS (shared pages split fairly), and the largest single
process RSS. The import-only baseline (Python + torch + numpy) is shown too.
A table is printed, then one JSON line.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading

from benchmarks.timing import REPO, Report, Stats, add_results_flag, time_call

DEFAULT_SOURCE = os.path.join(REPO, "..", "shared", "data", "wikitext-2-mini", "wiki.train.tokens")

try:
    import psutil
except ImportError:  # peak memory then comes from getrusage only (largest single process)
    psutil = None


def make_corpus(source: str, dest: str, size_mb: float) -> int:
    """Repeat ``source`` into ``dest`` until it holds at least ``size_mb`` MB; return its size."""
    data = open(source, "rb").read()
    if not data.endswith(b"\n"):
        data += b"\n"
    reps = -(-int(size_mb * 1e6) // len(data))
    per_write = max(1, (16 << 20) // len(data))
    with open(dest, "wb") as f:
        while reps > 0:
            n = min(per_write, reps)
            f.write(data * n)
            reps -= n
    return os.path.getsize(dest)


class TreeMemory(threading.Thread):
    """Samples the memory of a process and all its descendants until stopped."""

    def __init__(self, pid: int, interval: float = 0.05, pss_every: int = 10):
        super().__init__(daemon=True)
        self.pid, self.interval, self.pss_every = pid, interval, pss_every
        self.peak_rss_sum = self.peak_pss_sum = self.peak_rss_max = 0
        self.max_procs = 0
        self._halt = threading.Event()

    def run(self) -> None:
        if psutil is None:
            return
        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        tick = 0
        while not self._halt.is_set():
            try:
                procs = [root] + root.children(recursive=True)
            except psutil.Error:
                break
            rss, pss = [], []
            for p in procs:
                try:
                    rss.append(p.memory_info().rss)
                    if tick % self.pss_every == 0:
                        pss.append(p.memory_full_info().pss)
                except (psutil.Error, AttributeError):
                    pass
            if rss:
                self.peak_rss_sum = max(self.peak_rss_sum, sum(rss))
                self.peak_rss_max = max(self.peak_rss_max, max(rss))
                self.max_procs = max(self.max_procs, len(rss))
            if pss:
                self.peak_pss_sum = max(self.peak_pss_sum, sum(pss))
            tick += 1
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def run_tool(argv, log_path):
    """Run toolkit-preprocess; return (returncode, wall seconds, cpu seconds of the tree, memory sampler)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)

    def run():
        with open(log_path, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "toolkit_cli.preprocess", *argv], stdout=out, stderr=subprocess.STDOUT, cwd=REPO
            )
            sampler = TreeMemory(proc.pid)
            sampler.start()
            rc = proc.wait()
            sampler.stop()
        return rc, sampler

    wall, (rc, sampler) = time_call(run)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if rc != 0:
        sys.exit(f"toolkit-preprocess failed ({rc}):\n" + open(log_path).read()[-3000:])
    return wall, cpu, sampler, after.ru_maxrss * 1024  # ru_maxrss is in KiB on Linux


def parse_log(text: str) -> dict:
    out = {}
    m = re.search(r"\[None\] Dictionary: .*?: (\d+) tokens .*? in ([\d.]+)s", text)
    if m:
        out["dictionary_s"] = float(m.group(2))
    m = re.search(r"\[None\] train: ids renumbered in ([\d.]+)s", text)
    if m:
        out["renumber_s"] = float(m.group(1))
    m = re.search(r"\[None\] valid: binarized in ([\d.]+)s", text)
    if m:
        out["binarize_s"] = float(m.group(1))
    m = re.search(r"\[None\] .*?: (\d+) sents, (\d+) tokens, (\S+)% replaced", text)
    if m:
        out["sents"], out["tokens"] = int(m.group(1)), int(m.group(2))
    return out


def baseline() -> tuple:
    """(max RSS, CPU seconds) of a process that only imports the tool: its fixed start-up cost."""
    code = (
        "import resource, toolkit.data.preprocess, toolkit_cli.preprocess; "
        "r = resource.getrusage(resource.RUSAGE_SELF); print(r.ru_maxrss, r.ru_utime + r.ru_stime)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    rss_kib, cpu = out.stdout.split()
    return int(rss_kib) * 1024, float(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=200.0, help="corpus size in MB (default 200)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts (default 1 2)")
    parser.add_argument("--source", default=DEFAULT_SOURCE, help="text file repeated into the corpus")
    parser.add_argument("--tmpdir", default=None, help="where the temporary corpus goes (default: system temp)")
    add_results_flag(parser)
    args = parser.parse_args()
    report = Report("preprocess")

    mb = 1 << 20
    work = tempfile.mkdtemp(prefix="toolkit-preprocess-bench.", dir=args.tmpdir)
    try:
        corpus = os.path.join(work, "corpus.txt")
        size = make_corpus(args.source, corpus, args.size_mb)
        base, base_cpu = baseline()
        print(
            f"corpus: {size / 1e6:.0f} MB ({os.path.basename(args.source)} repeated) in {work}; "
            f"CPUs usable: {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()}; "
            f"load average now: {os.getloadavg()[0]:.2f}"
        )
        print(
            f"start-up of one process (python + torch + numpy imports): {base / mb:.0f} MiB RSS, "
            f"{base_cpu:.2f} CPU-s (subtracted from cpu_s for tokens per CPU-second)"
        )
        rows = []
        for workers in args.workers:
            for mode in ("pipeline", "binarize"):
                dest = os.path.join(work, f"bin-{mode}-{workers}")
                log = os.path.join(work, f"log-{mode}-{workers}.txt")
                common = ["--only-source", "--destdir", dest, "--workers", str(workers), "--no-progress-bar"]
                if mode == "pipeline":
                    argv = common + ["--trainpref", corpus]
                else:
                    argv = common + [
                        "--srcdict",
                        os.path.join(work, f"bin-pipeline-{workers}", "dict.txt"),
                        "--validpref",
                        corpus,
                    ]
                wall, cpu, mem, _ = run_tool(argv, log)
                info = parse_log(open(log).read())
                work_s = (
                    (info.get("dictionary_s", 0) + info.get("renumber_s", 0))
                    if mode == "pipeline"
                    else info["binarize_s"]
                )
                tokens = info["tokens"]
                rows.append(
                    {
                        "mode": mode,
                        "workers": workers,
                        "tokens": tokens,
                        "sents": info["sents"],
                        "work_s": round(work_s, 3),
                        "process_wall_s": round(wall, 3),
                        "cpu_s": round(cpu, 3),
                        "tokens_per_s": round(tokens / work_s),
                        "tokens_per_s_per_worker": round(tokens / work_s / workers),
                        "tokens_per_cpu_s": round(tokens / max(cpu - base_cpu, 1e-3)),
                        "peak_tree_rss_mib": round(mem.peak_rss_sum / mb, 1) if psutil else None,
                        "peak_tree_pss_mib": round(mem.peak_pss_sum / mb, 1) if psutil else None,
                        "peak_process_rss_mib": round(mem.peak_rss_max / mb, 1) if psutil else None,
                        "processes": mem.max_procs if psutil else None,
                        **(
                            {"dictionary_s": info["dictionary_s"], "renumber_s": info["renumber_s"]}
                            if mode == "pipeline"
                            else {}
                        ),
                    }
                )
                if mode == "binarize":
                    shutil.rmtree(dest, ignore_errors=True)
        # outputs must not depend on the number of workers
        bins = [os.path.join(work, f"bin-pipeline-{w}") for w in args.workers]
        identical = all(
            open(os.path.join(b, f), "rb").read() == open(os.path.join(bins[0], f), "rb").read()
            for b in bins[1:]
            for f in ("dict.txt", "train.idx", "train.bin")
        )

        header = (
            f"{'mode':<9} {'workers':>7} {'Mtokens':>8} {'work s':>7} {'Mtok/s':>7} {'Mtok/s/wkr':>10} "
            f"{'Mtok/cpu-s':>10} {'tree RSS':>9} {'tree PSS':>9} {'max proc':>9}"
        )
        print(header)
        print("-" * len(header))
        for r in rows:
            fmt = lambda v: f"{v:.0f}M" if v is not None else "-"  # noqa: E731
            print(
                f"{r['mode']:<9} {r['workers']:>7} {r['tokens'] / 1e6:>8.1f} {r['work_s']:>7.2f} "
                f"{r['tokens_per_s'] / 1e6:>7.2f} {r['tokens_per_s_per_worker'] / 1e6:>10.2f} "
                f"{r['tokens_per_cpu_s'] / 1e6:>10.2f} {fmt(r['peak_tree_rss_mib']):>9} "
                f"{fmt(r['peak_tree_pss_mib']):>9} {fmt(r['peak_process_rss_mib']):>9}"
            )
        print(f"(MiB; 'work s' excludes process start-up; outputs identical across worker counts: {identical})")
        report.emit(
            {f"{r['mode']} x{r['workers']}": Stats([r["work_s"]]) for r in rows},
            results=args.results,
            corpus_bytes=size,
            baseline_rss_mib=round(base / mb, 1),
            baseline_cpu_s=round(base_cpu, 3),
            identical_across_workers=identical,
            rows=rows,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
