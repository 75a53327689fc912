"""The offloaded update, serial vs ``--overlap-offload-step``: ``Trainer.train_step`` time in steady state.

    python -m benchmarks.offload_overlap                       # CPU: a small model, fp32, 2 threads
    python -m benchmarks.offload_overlap --fold-only 50e6      # CPUAdam alone: separate multiply vs folded
    python -m benchmarks.offload_overlap --device cuda --arch transformer_lm_gpt3_2_7 \\
        --tokens-per-sample 2048 --batch-size 8 --fp16 --fp16-init-scale 4 --checkpoint-activations

Both trainers are built in one process (same seed, same synthetic batch, the real path:
``benchmarks/train.py``'s ``build``) with ``--ddp-backend fully_sharded --cpu-offload
--optimizer cpu_adam``; one of them adds ``--overlap-offload-step``. Rounds alternate
between them (:func:`benchmarks.timing.alternate`), so a noisy neighbour hits both alike. A round is ``--steps`` consecutive
updates and then a wait for the last update still running (so each round's time holds
all of its work); step time = round time / steps. The host-side time of the gradient norm
(after backward) and of the optimizer step (for the overlap: launching it) is timed
inside the same steps. At the end both models must hold the same bits (the same updates).

On a CPU the forward, the backward and CPU Adam all compete for the same cores: the
overlap has no idle hardware to fill and can only save the host norm pass that it moves
into backward. The figures it is meant for come from a GPU (benchmarks/gpu.sh offload_overlap).
Prints a table and one JSON line (``"benchmark": "offload_overlap"``).
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace
from typing import Dict, List

import torch

from benchmarks.timing import Report, add_results_flag, alternate, median, now
from benchmarks.train import build, synthetic_sample

SMALL = [
    "--arch",
    "transformer_lm",
    "--decoder-layers",
    "6",
    "--decoder-embed-dim",
    "512",
    "--decoder-ffn-embed-dim",
    "2048",
    "--decoder-attention-heads",
    "8",
    "--tokens-per-sample",
    "64",
    "--batch-size",
    "2",
]
OFFLOAD = ["--ddp-backend", "fully_sharded", "--cpu-offload", "--optimizer", "cpu_adam", "--clip-norm", "1.0"]


def parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads on CPU (default 2)")
    ap.add_argument("--vocab", type=int, default=8192, help="dictionary size of the synthetic data")
    ap.add_argument("--warmup", type=int, default=2, help="untimed updates per trainer")
    ap.add_argument("--steps", type=int, default=4, help="consecutive updates per round")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per trainer (interleaved)")
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument(
        "--fold-only",
        type=float,
        default=None,
        metavar="PARAMS",
        help="only time CPUAdam's update of PARAMS fp32 parameters (e.g. 50e6): a separate "
        "_foreach_mul_ then step(), against step(grad_scale=...) with the multiply folded in",
    )
    add_results_flag(ap)
    ours, rest = ap.parse_known_args(argv)
    return ours, (rest or SMALL) + OFFLOAD


class HostTimer:
    """Seconds the main thread spends in the trainer's norm and step calls (wrapped on the instance)."""

    def __init__(self, trainer):
        self.seconds: Dict[str, float] = {"norm": 0.0, "update_call": 0.0}
        for name, attr in (("norm", "_grad_norm_for_step"), ("update_call", "_step_optimizer")):
            setattr(trainer, attr, self._timed(name, getattr(trainer, attr)))

    def _timed(self, name, fn):
        def run(*args, **kwargs):
            t0 = now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += now() - t0

        return run


def round_of(trainer, sample, steps: int, timer: HostTimer, host: List[Dict[str, float]]) -> None:
    """``steps`` updates, then a wait for the one still in flight; the host time of the norm and of the step call
    per update appended to ``host``."""
    from toolkit.logging import metrics

    trainer.finish_pending_steps()
    before = dict(timer.seconds)
    for _ in range(steps):
        with metrics.aggregate("train_inner"):
            if trainer.train_step([sample]) is None:
                raise RuntimeError("an fp16 overflow skipped a timed update; add --warmup or lower --fp16-init-scale")
    trainer.finish_pending_steps()
    host.append({f"{k}_ms": 1e3 * (timer.seconds[k] - before[k]) / steps for k in timer.seconds})


def fold_figures(total: int, rounds: int, report: Report, results) -> None:
    """CPUAdam's update with the normalization multiply as its own pass, and folded in (the same bits)."""
    from benchmarks.optim import make_params
    from toolkit.optim.cpu_adam import CPUAdam

    runs = {}
    for name in ("separate", "folded"):
        params = make_params(total, 1024)
        runs[name] = (params, CPUAdam(params, lr=1e-4, weight_decay=0.01))
    factor = 0.731 / 8192

    def separate():
        params, opt = runs["separate"]
        torch._foreach_mul_([p.grad for p in params], factor)
        opt.step()

    # the warm-up round allocates the states: not counted
    stats = alternate({"separate": separate, "folded": lambda: runs["folded"][1].step(grad_scale=factor)}, rounds, 1)
    same = all(torch.equal(a, b) for a, b in zip(runs["separate"][0], runs["folded"][0]))
    n = sum(p.numel() for p in runs["folded"][0])
    med = {k: 1e3 * s.median for k, s in stats.items()}
    best = {k: 1e3 * s.min for k, s in stats.items()}
    print(
        f"CPUAdam update of {n / 1e6:.1f}M fp32 params, {torch.get_num_threads()} threads, {rounds} rounds: "
        f"separate multiply + step {med['separate']:.1f} ms (best {best['separate']:.1f}), "
        f"folded {med['folded']:.1f} ms (best {best['folded']:.1f}); parameters identical: {same}"
    )
    report.name = "cpu_adam_fold"
    report.emit(stats, "separate", results, params=n, median_ms=med, best_ms=best, identical=same)


def main(argv=None) -> None:
    ours, train_argv = parse(argv)
    device = torch.device(ours.device)
    if device.type == "cpu":
        torch.set_num_threads(ours.threads or 2)
    report = Report("offload_overlap", device=device, argv=argv)
    if ours.fold_only:
        return fold_figures(int(ours.fold_only), max(ours.rounds, 3), report, ours.results)
    trainers, timers = {}, {}
    for name, extra in (("serial", []), ("overlap", ["--overlap-offload-step"])):
        flags = SimpleNamespace(device=str(device), bf16=ours.bf16, fp16=ours.fp16, vocab=ours.vocab, fp8_experts=False)
        args, task, _, _, trainer = build(flags, train_argv + extra)
        trainers[name], timers[name] = trainer, HostTimer(trainer)
    sample = synthetic_sample(args, task.dictionary, device)
    for name, trainer in trainers.items():
        for _ in range(ours.warmup):
            trainer.train_step([sample])
    host: Dict[str, List[Dict[str, float]]] = {name: [] for name in trainers}
    contestants = {
        name: lambda name=name: round_of(trainers[name], sample, ours.steps, timers[name], host[name])
        for name in trainers
    }
    stats = alternate(contestants, ours.rounds, device=device)
    same = all(
        torch.equal(a.detach().to_local(), b.detach().to_local())
        for a, b in zip(trainers["serial"].model.parameters(), trainers["overlap"].model.parameters())
    )
    summarize(ours, args, trainers["serial"], stats, host, same, device, report)


def summarize(ours, args, trainer, stats, host, same: bool, device: torch.device, report: Report) -> None:
    n_params = sum(p.numel() for p in trainer.model.parameters())
    where = f"{torch.get_num_threads()} threads" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(
        f"{args.arch}: {n_params / 1e6:.1f}M params, B={args.batch_size} T={args.tokens_per_sample}, "
        f"{str(trainer.compute_dtype).replace('torch.', '')} on {device} ({where}); {ours.rounds} rounds of "
        f"{ours.steps} updates each; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    )
    print(f"{'':<10}{'step ms (median)':>18}{'best':>10}{'norm ms':>10}{'update call ms':>16}")
    summary = {}
    for name, rs in host.items():
        med = {"step_ms": 1e3 * stats[name].median / ours.steps, **{k: median([r[k] for r in rs]) for k in rs[0]}}
        best = 1e3 * stats[name].min / ours.steps
        summary[name] = dict(med, best_step_ms=best)
        print(f"{name:<10}{med['step_ms']:>18.1f}{best:>10.1f}{med['norm_ms']:>10.1f}{med['update_call_ms']:>16.1f}")
    speedup = summary["serial"]["step_ms"] / summary["overlap"]["step_ms"]
    print(f"overlap vs serial: {speedup:.3f}x (median step time); parameters identical: {same}")
    report.emit(
        stats,
        "serial",
        ours.results,
        device=str(device),
        arch=args.arch,
        params=n_params,
        steps_per_round=ours.steps,
        speedup=speedup,
        identical=same,
        **summary,
    )


if __name__ == "__main__":
    main()
