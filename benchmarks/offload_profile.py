"""Where an offloaded update's time goes: GPU compute, host <-> GPU copies and their overlap, CPU Adam, the 8-bit path.

    python -m benchmarks.offload_profile --device cuda --arch transformer_lm_gpt3_13 --tokens-per-sample 2048 \\
        --batch-size 8 --vocab 12448 --fp16 --fp16-init-scale 4 --checkpoint-activations \\
        --adam-state-precision 8bit --bf16-host-grads --overlap-offload-step --out offload_profile_13.md
    python -m benchmarks.offload_profile --arch transformer_lm --decoder-layers 2 --decoder-embed-dim 64 \\
        --adam-state-precision 8bit --vocab 512 --warmup 1 --steps 1          # CPU: the host side only

The trainer is built as ``benchmarks.train`` builds it (toolkit-train's parser, ``build_parallel_model``, the
``Trainer``) with ``--ddp-backend fully_sharded --cpu-offload --optimizer cpu_adam`` and the flags given, on
synthetic tokens. ``--warmup`` updates run first (the first pays for the ops' loading and the states'
allocation), then ``--steps`` updates run under ``torch.profiler`` (CPU, and CUDA on a GPU), each followed by
``finish_pending_steps`` so that an overlapped CPU Adam is inside the window. From the profiler's trace:

* GPU compute: the union of the kernels' intervals (not their sum: streams overlap);
* host-to-device and device-to-host copies: their bytes, the union of their intervals, the rate, and how much of
  the copy time ran while a kernel ran (the overlap FSDP2's prefetch and ``--overlap-offload-step`` aim at);
* GPU idle: the update's wall time covered by neither kernels nor copies.

From the host side, timed on whichever thread runs them (``--overlap-offload-step``'s worker too) and marked as
profiler ranges: ``CPUAdam.run_step`` (the whole CPU Adam), ``ReducedMoments.update`` (the bf16/8-bit moments'
path: decode, DeepSpeed's update, encode) and ``fused_8bit.update`` (the fused 8-bit kernel inside it); the
CPU Adam time that ran while a kernel ran (its ranges against the kernels', where the trace holds them).

Writes the table (markdown) to ``--out`` and prints it, then one JSON line (``"benchmark": "offload_profile"``)
whose figures ``benchmarks.plan_calibration`` reads beside toolkit-plan's terms. On a CPU the GPU rows are 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
import threading
from collections import defaultdict
from typing import Any, Dict, Iterable, List, Tuple

import torch

from benchmarks.timing import Report, Stats, now, write_text
from benchmarks.train import build, parse, synthetic_sample

OFFLOAD = ["--ddp-backend", "fully_sharded", "--cpu-offload", "--optimizer", "cpu_adam"]
CPU_ADAM, MOMENTS, FUSED_8BIT = "CPUAdam.run_step", "ReducedMoments.update", "fused_8bit.update"
UPDATE = "offload_profile.update"
Interval = Tuple[float, float]


class HostSpans:
    """Seconds and calls of wrapped host functions, from any thread; each call is also a profiler range."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = defaultdict(float)
        self.calls: Dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self._undo: List[Tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        original = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            with torch.profiler.record_function(label):
                start = now()
                try:
                    return original(*args, **kwargs)
                finally:
                    with self._lock:
                        self.seconds[label] += now() - start
                        self.calls[label] += 1

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, original))

    def reset(self) -> None:
        with self._lock:
            self.seconds.clear()
            self.calls.clear()

    def restore(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)


def wrap_optimizer_paths(spans: HostSpans) -> None:
    """Before the trainer is built: the optimizer takes ``fused_8bit.update`` when it is made."""
    from toolkit.optim import cpu_adam, fused_8bit, quantized_states

    spans.wrap(cpu_adam.CPUAdam, "run_step", CPU_ADAM)
    spans.wrap(quantized_states.ReducedMoments, "update", MOMENTS)
    spans.wrap(fused_8bit, "update", FUSED_8BIT)


def union(intervals: Iterable[Interval]) -> List[Interval]:
    out: List[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in union(intervals))


def overlap(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """Length of the intersection of two sets of intervals."""
    a, b = union(a), union(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def trace_figures(events: List[Dict[str, Any]], steps: int) -> Dict[str, float]:
    """Per update, from a chrome trace's events (microseconds there, seconds here)."""

    def spans(chosen: Iterable[Dict[str, Any]]) -> List[Interval]:
        return [(e["ts"] / 1e6, (e["ts"] + e.get("dur", 0)) / 1e6) for e in chosen]

    def named(name: str) -> List[Interval]:
        return spans(e for e in events if e.get("cat") == "user_annotation" and e.get("name") == name)

    kernels = spans(e for e in events if e.get("cat") == "kernel")
    copies = {
        d: [e for e in events if e.get("cat") == "gpu_memcpy" and d in e.get("name", "")] for d in ("HtoD", "DtoH")
    }
    copy_spans = {d: spans(chosen) for d, chosen in copies.items()}
    every_copy = copy_spans["HtoD"] + copy_spans["DtoH"]
    adam, updates = named(CPU_ADAM), named(UPDATE)
    wall = sum(end - start for start, end in updates)
    out = {
        "update_s": wall,
        "gpu_compute_s": length(kernels),
        "h2d_bytes": sum(e.get("args", {}).get("bytes", 0) for e in copies["HtoD"]),
        "d2h_bytes": sum(e.get("args", {}).get("bytes", 0) for e in copies["DtoH"]),
        "h2d_s": length(copy_spans["HtoD"]),
        "d2h_s": length(copy_spans["DtoH"]),
        "copies_s": length(every_copy),
        "copies_under_compute_s": overlap(every_copy, kernels),
        "gpu_idle_s": max(0.0, wall - length(kernels + every_copy)) if kernels or every_copy else 0.0,
        "cpu_adam_under_compute_s": overlap(adam, kernels),
        "cpu_adam_ranges_s": length(adam),
    }
    out = {k: v / steps for k, v in out.items()}
    if not adam:  # a worker thread's ranges (--overlap-offload-step) need not reach the trace: unknown, not 0
        out["cpu_adam_under_compute_s"] = out["cpu_adam_ranges_s"] = None
    return out


def profile_updates(trainer, sample, steps: int, device: torch.device) -> Tuple[List[Dict[str, Any]], Stats]:
    """``steps`` updates under torch.profiler, each with its overlapped CPU Adam finished inside the window:
    (the trace's events, the updates' wall times)."""
    from torch.profiler import ProfilerActivity, profile

    from toolkit.logging import metrics

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    seconds = []
    with profile(activities=activities) as prof, metrics.aggregate("train"):
        for _ in range(steps):
            start = now()
            with torch.profiler.record_function(UPDATE):
                with metrics.aggregate("train_inner"):
                    trainer.train_step([sample])
                trainer.finish_pending_steps()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            seconds.append(now() - start)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return events, Stats(seconds)


def table(figures: Dict[str, Any]) -> str:
    """The markdown table of one update's figures."""
    f, wall = figures, figures["update_s"] or 1.0
    rate = lambda n, s: f"{n / s / 1e9:.1f} GB/s" if s else "-"  # noqa: E731
    ms = lambda s: "-" if s is None else f"{1e3 * s:,.1f}"  # noqa: E731
    share = lambda s: "-" if s is None else f"{s / wall:.0%}"  # noqa: E731
    rows = [
        ("update (wall)", f["update_s"], ""),
        ("GPU compute (kernels' union)", f["gpu_compute_s"], ""),
        ("host-to-device copies", f["h2d_s"], f"{f['h2d_bytes'] / 1e9:.2f} GB at {rate(f['h2d_bytes'], f['h2d_s'])}"),
        ("device-to-host copies", f["d2h_s"], f"{f['d2h_bytes'] / 1e9:.2f} GB at {rate(f['d2h_bytes'], f['d2h_s'])}"),
        ("copies while a kernel ran", f["copies_under_compute_s"], "of the copies' union"),
        ("GPU idle (no kernel, no copy)", f["gpu_idle_s"], ""),
        ("CPU Adam (CPUAdam.run_step, all threads)", f["cpu_adam_s"], f"{f['cpu_adam_calls']:.0f} calls"),
        ("  bf16/8-bit moments path", f["moments_s"], "ReducedMoments.update"),
        ("  of which the fused 8-bit kernel", f["fused_8bit_s"], "fused_8bit.update"),
        (
            "CPU Adam while a kernel ran",
            f["cpu_adam_under_compute_s"],
            "its ranges against the kernels (- : none traced)",
        ),
    ]
    lines = [
        f"One offloaded update of {f['arch']} ({f['params'] / 1e9:.2f}B parameters, {f['tokens_per_step']} tokens) "
        f"on {f['device']}; {f['flags']}; the mean of {f['steps']} profiled updates after {f['warmup']}",
        "",
        "| what | ms per update | share of the update | note |",
        "| --- | ---: | ---: | --- |",
    ]
    lines += [f"| {name} | {ms(s)} | {share(s)} | {note} |" for name, s, note in rows]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--out", default=None, help="write the table (markdown) to this file")
    mine, rest = ap.parse_known_args(argv)
    ours, train_argv = parse(rest)
    device = torch.device(ours.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif not ours.threads:
        torch.set_num_threads(2)
    if ours.threads:
        torch.set_num_threads(ours.threads)
    report = Report("offload_profile", device=device, argv=argv)
    spans = HostSpans()
    wrap_optimizer_paths(spans)
    try:
        args, task, model, _, trainer = build(ours, OFFLOAD + train_argv)
        sample = synthetic_sample(args, task.dictionary, device)
        for _ in range(ours.warmup):
            trainer.train_step([sample])
        trainer.finish_pending_steps()
        spans.reset()
        events, stats = profile_updates(trainer, sample, ours.steps, device)
    finally:
        spans.restore()
    figures: Dict[str, Any] = trace_figures(events, ours.steps)
    figures.update(
        arch=args.arch,
        params=sum(p.numel() for p in model.parameters()),
        tokens_per_step=sample["ntokens"],
        device=str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        flags=" ".join(rest),
        steps=ours.steps,
        warmup=ours.warmup,
        adam_state_precision=args.adam_state_precision,
        bf16_host_grads=bool(args.bf16_host_grads),
        overlap_offload_step=bool(args.overlap_offload_step),
        cpu_adam_s=spans.seconds[CPU_ADAM] / ours.steps,
        cpu_adam_calls=spans.calls[CPU_ADAM] / ours.steps,
        moments_s=spans.seconds[MOMENTS] / ours.steps,
        fused_8bit_s=spans.seconds[FUSED_8BIT] / ours.steps,
    )
    text = table(figures)
    print(text)
    if mine.out:
        write_text(mine.out, text)
    report.emit({"update": stats}, results=ours.results, **figures)


if __name__ == "__main__":
    main()
