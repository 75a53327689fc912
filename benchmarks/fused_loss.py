"""The output layer + cross-entropy, forward and backward, with logits ([N, V] fp32, then the loss) against the
fused chunked head (``toolkit.models.fused_loss``) at several chunk sizes, on CPU.

    python -m benchmarks.fused_loss                         # N 2048 (B 8 x T 256), C 256, V 8192: llama_hf.py's head
    python -m benchmarks.fused_loss --rows 4096 --vocab 32000 --chunks 512,1024,2048

Time: the variants alternated step by step in one process (:func:`benchmarks.timing.alternate`: a busy neighbour
slows all alike), the median of ``--rounds`` after one warm-up round. Memory: each variant once more in a fresh process, its peak resident memory during the step minus
before it (the largest temporaries: logits, their gradient, softmax). Prints one JSON line
(``"benchmark": "fused_loss"``).
"""

from __future__ import annotations

import argparse
import subprocess

import torch
import torch.nn.functional as F

from benchmarks.timing import REPO, Report, add_results_flag, alternate, module_argv
from toolkit.models.fused_loss import linear_cross_entropy

PAD = 1


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048, help="N = B x T tokens")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--chunks", default="256,512,1024,2048", help="chunk sizes (rows) to time")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)  # one variant's peak, in a child process
    add_results_flag(ap)
    return ap.parse_args(argv)


def inputs(args):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.rows, args.dim, generator=g).requires_grad_()
    weight = (torch.randn(args.vocab, args.dim, generator=g) * 0.02).requires_grad_()
    return hidden, weight, torch.randint(PAD + 1, args.vocab, (args.rows,), generator=g)


def step_of(variant: str):
    """One forward + backward of the head and loss: ``logits`` or the fused head at ``int(variant)`` rows."""

    def step(hidden, weight, target):
        if variant == "logits":
            loss = F.cross_entropy(F.linear(hidden, weight).float(), target, ignore_index=PAD, reduction="sum")
        else:
            loss = linear_cross_entropy(hidden, weight, target, PAD, int(variant))
        loss.backward()
        hidden.grad = weight.grad = None

    return step


def high_water_kib() -> int:
    """This process's peak resident memory (Linux's VmHWM: unlike ``ru_maxrss``, not inherited over fork + exec
    from the parent)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def peak_mib(variant: str, args) -> float:
    """The step's peak resident memory above what the process held before it (MiB), in a fresh process."""
    cmd = [
        *module_argv("fused_loss"),
        "--memory-of",
        variant,
        "--rows",
        str(args.rows),
        "--dim",
        str(args.dim),
        "--vocab",
        str(args.vocab),
        "--threads",
        str(args.threads),
    ]
    return float(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO).stdout.split()[-1])


def main(argv=None) -> None:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    hidden, weight, target = inputs(args)
    if args.memory_of is not None:
        before = high_water_kib()  # the inputs held; a step before this one would set the peak
        step_of(args.memory_of)(hidden, weight, target)
        print((high_water_kib() - before) / 1024)
        return
    report = Report("fused_loss", argv=argv)
    variants = ["logits"] + args.chunks.split(",")
    stats = alternate({v: lambda v=v: step_of(v)(hidden, weight, target) for v in variants}, args.rounds, warmup=1)
    median = {v: s.median * 1e3 for v, s in stats.items()}
    result = {
        "rows": args.rows,
        "dim": args.dim,
        "vocab": args.vocab,
        "threads": args.threads,
        "rounds": args.rounds,
        "step_ms": {v: round(m, 1) for v, m in median.items()},
        "speedup_over_logits": {v: round(median["logits"] / m, 3) for v, m in median.items()},
        "peak_step_mib": {v: round(peak_mib(v, args), 1) for v in variants},
    }
    for v in variants:
        print(
            f"{v:>8}: {median[v]:8.1f} ms  {result['speedup_over_logits'][v]:5.2f}x  "
            f"peak +{result['peak_step_mib'][v]:7.1f} MiB"
        )
    report.emit(stats, baseline="logits", results=args.results, **result)


if __name__ == "__main__":
    main()
