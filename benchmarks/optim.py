"""Optimizer step time on CPU: DeepSpeed CPU Adam (``--optimizer cpu_adam``) vs torch AdamW.

    python -m benchmarks.optim [--params 100e6] [--warmup 2] [--steps 5] [--threads N]

cpu_adam is toolkit's wrapper (torch-layout state, DTensor-safe); deepspeed_raw is
DeepSpeedCPUAdam called directly, to show the wrapper's overhead.

fp32 parameters shaped like a transformer LM's (square and 4x matrices, vectors), with
random gradients; each optimizer gets a few untimed warm-up steps, then ``--steps`` timed
steps, alternated (:func:`benchmarks.timing.alternate`). Prints a table (Mparam/s and "speed vs fused" from the
fastest step) and one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch

from benchmarks.timing import Report, add_results_flag, alternate


def make_params(total: int, dim: int):
    """Transformer-like tensors (d x d, 4d x d, d x 4d, biases) adding up to about ``total`` elements."""
    block = [(dim, dim)] * 4 + [(4 * dim, dim), (dim, 4 * dim)] + [(dim,)] * 6 + [(4 * dim,)]
    per_block = sum(torch.Size(s).numel() for s in block)
    shapes = block * max(1, round(total / per_block))
    g = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.empty(s).normal_(0, 0.02, generator=g))
        p.grad = torch.empty(s).normal_(0, 1e-3, generator=g)
        params.append(p)
    return params


def build(name: str, params):
    if name == "cpu_adam":
        from toolkit.optim.cpu_adam import CPUAdam

        return CPUAdam(params, lr=1e-4, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    if name == "deepspeed_raw":  # DeepSpeedCPUAdam itself, to show the wrapper's overhead
        from toolkit.optim.deepspeed_op import load_deepspeed_cpu_adam

        return load_deepspeed_cpu_adam()(
            params, lr=1e-4, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01, adamw_mode=True
        )
    kw = {
        "torch_adamw_foreach": dict(foreach=True),
        "torch_adamw_fused": dict(fused=True),
        "torch_adamw_forloop": dict(foreach=False),
    }[name]
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01, **kw)


def bench(names, total: int, dim: int, warmup: int, steps: int):
    """Alternated: every round times one step of each optimizer, so a noisy neighbour on a shared
    machine hits all of them alike; the minimum over rounds is the least disturbed figure."""
    opts, sizes = {}, {}
    for name in names:
        params = make_params(total, dim)
        sizes[name] = sum(p.numel() for p in params)
        opts[name] = build(name, params)
    stats = alternate({name: opt.step for name, opt in opts.items()}, steps, warmup)
    del opts
    gc.collect()
    return sizes, stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=100e6, help="number of parameters (default: 100e6)")
    ap.add_argument("--dim", type=int, default=768, help="model dimension of the tensor shapes")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads (default: torch's)")
    ap.add_argument("--optimizers", default="cpu_adam,deepspeed_raw,torch_adamw_foreach,torch_adamw_fused")
    add_results_flag(ap)
    args = ap.parse_args(argv)
    report = Report("optimizer_step_cpu", argv=argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)

    names = args.optimizers.split(",")
    sizes, stats = bench(names, int(args.params), args.dim, args.warmup, args.steps)
    rows = []
    for name in names:
        n, st = sizes[name], stats[name]
        rows.append(
            {
                "optimizer": name,
                "params": n,
                "median_ms": 1e3 * st.median,
                "min_ms": 1e3 * st.min,
                "max_ms": 1e3 * st.max,
                "Mparams_per_s": n / st.min / 1e6,
            }
        )
    base = next((r["min_ms"] for r in rows if r["optimizer"] == "torch_adamw_fused"), None)
    print(
        f"{'optimizer':<22}{'params':>12}{'median ms':>12}{'min ms':>10}{'Mparam/s':>10}"
        + ("{:>16}".format("speed vs fused") if base else "")
    )
    for r in rows:
        line = (
            f"{r['optimizer']:<22}{r['params']:>12,}{r['median_ms']:>12.1f}{r['min_ms']:>10.1f}"
            f"{r['Mparams_per_s']:>10.0f}"
        )
        if base:
            line += f"{base / r['min_ms']:>15.2f}x"
        print(line)
    baseline = "torch_adamw_fused" if "torch_adamw_fused" in stats else None
    report.emit(stats, baseline, args.results, dtype="float32", warmup=args.warmup, steps=args.steps, rows=rows)


if __name__ == "__main__":
    main()
