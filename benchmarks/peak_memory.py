"""Run a command and report its peak host memory (whole process tree) and the GPU's peak use.

    python -m benchmarks.peak_memory -- toolkit-train data-bin/x --arch ... --cpu-offload ...
    python -m benchmarks.peak_memory --interval 0.2 --json out.json -- python -m benchmarks.train ...

Why a wrapper: with ``--cpu-offload`` most of the training state lives in host memory
(pinned fp32 shards, gradients, optimizer state) and in the spawned workers, which the
trainer's own ``gb_free`` (GPU only) does not show. The wrapper samples, every
``--interval`` seconds, the resident set of the command and all its descendants
(summed; pinned host memory is resident, so it counts) and, where NVIDIA's management
library is importable, the memory in use on each GPU (all processes, CUDA contexts
included). The command's output passes through; its exit status is returned.

Prints one summary line and one JSON line (``"benchmark": "peak_memory"``) on stderr
after the command ends; ``--json FILE`` also writes that JSON to FILE.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from typing import Dict, List, Optional

import psutil

from benchmarks.timing import now


def tree_rss(root: psutil.Process) -> int:
    """Bytes resident in ``root`` and its descendants (processes that vanish mid-count are skipped)."""
    total = 0
    try:
        procs = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def gpu_handles() -> List:
    try:
        import pynvml

        pynvml.nvmlInit()
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # no NVIDIA library or no GPU: host memory only
        return []


def gpu_used(handles: List) -> List[int]:
    import pynvml

    return [pynvml.nvmlDeviceGetMemoryInfo(h).used for h in handles]


class Sampler(threading.Thread):
    def __init__(self, proc: psutil.Process, interval: float):
        super().__init__(daemon=True)
        self.proc, self.interval = proc, interval
        self.handles = gpu_handles()
        self.gpu_baseline = gpu_used(self.handles) if self.handles else []
        self.peak_rss = 0
        self.peak_gpu = list(self.gpu_baseline)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.interval)

    def sample(self) -> None:
        self.peak_rss = max(self.peak_rss, tree_rss(self.proc))
        if self.handles:
            self.peak_gpu = [max(a, b) for a, b in zip(self.peak_gpu, gpu_used(self.handles))]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between samples (default 0.5)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the JSON summary to FILE")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the command to run after --")
    start = now()
    child = subprocess.Popen(cmd)
    sampler = Sampler(psutil.Process(child.pid), args.interval)
    sampler.start()
    try:
        rc = child.wait()
    except KeyboardInterrupt:
        child.terminate()
        rc = child.wait()
    sampler.stop.set()
    sampler.join()
    gib = 2**30
    result: Dict = {
        "benchmark": "peak_memory",
        "command": cmd,
        "exit_status": rc,
        "seconds": round(now() - start, 1),
        "peak_host_rss_gib": round(sampler.peak_rss / gib, 2),
        "host_total_gib": round(psutil.virtual_memory().total / gib, 1),
        "peak_gpu_used_gib": [round(b / gib, 2) for b in sampler.peak_gpu],
        "gpu_used_before_gib": [round(b / gib, 2) for b in sampler.gpu_baseline],
    }
    gpu = ", ".join(f"GPU{i} {b:.1f} GiB" for i, b in enumerate(result["peak_gpu_used_gib"])) or "no GPU seen"
    print(
        f"peak memory: host {result['peak_host_rss_gib']:.1f} GiB resident (process tree, of "
        f"{result['host_total_gib']:.0f}); {gpu} in use (all processes); exit status {rc}",
        file=sys.stderr,
    )
    print(json.dumps(result), file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return rc


if __name__ == "__main__":
    sys.exit(main())
