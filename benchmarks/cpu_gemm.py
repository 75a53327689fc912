"""fp32 matmul rates on this CPU: torch's (its BLAS, MKL in the x86 wheels) against oneDNN's, per product of a
linear layer, at the shapes of a small transformer's training step (``toolkit.core.cpu_gemm`` uses oneDNN where
``--cpu-matmul auto`` measures it faster).

    python -m benchmarks.cpu_gemm                  # 2 threads, the default shapes
    python -m benchmarks.cpu_gemm --threads 1 --rows 2048 --shapes 256x688,688x256,256x8192

For each layer shape IN x OUT and ``--rows`` M: the forward ``x [M, IN] @ W^T``, the input gradient
``dy [M, OUT] @ W`` and the weight gradient ``dy^T x`` (oneDNN's in the orientation ``cpu_gemm.mm_tn`` picks), each
timed alone (best of ``--repeats`` after a warm-up), the two libraries alternated (:func:`benchmarks.timing.alternate`). Prints GFLOP/s and
oneDNN / torch per product, the largest difference of the two results from a float64 product (both are fp32), and
one JSON line (``"benchmark": "cpu_gemm"``).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.timing import Report, add_results_flag, alternate
from toolkit.core import cpu_gemm


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=2048, help="M: tokens in the batch (B x T)")
    ap.add_argument(
        "--shapes",
        default="256x256,256x688,688x256,256x8192,512x12448",
        help="layer shapes IN x OUT, comma-separated (a 256-wide Llama's layers, its head, and fairseq "
        "transformer_lm's 512 x 12,448 output layer of the parity model)",
    )
    ap.add_argument("--repeats", type=int, default=5)
    add_results_flag(ap)
    return ap.parse_args(argv)


def products(m: int, k: int, n: int):
    """name -> (torch's product, oneDNN's product, float64 reference) for one linear layer [n, k] and m rows."""
    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(m, n, generator=g)
    return {
        "forward": (lambda: x @ w.t(), lambda: cpu_gemm.mm_nt(x, w), lambda: x.double() @ w.double().t()),
        "input grad": (lambda: dy @ w, lambda: cpu_gemm.mm_nn(dy, w), lambda: dy.double() @ w.double()),
        "weight grad": (lambda: dy.t() @ x, lambda: cpu_gemm.mm_tn(dy, x), lambda: dy.double().t() @ x.double()),
    }


def run(args):
    torch.set_num_threads(args.threads)
    if not cpu_gemm.onednn_available():
        raise SystemExit("this torch build has no oneDNN linear kernel: nothing to compare")
    cpu_gemm.select("onednn")
    rows, all_stats = [], {}
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.lower().split("x"))
        flops = 2.0 * args.rows * k * n
        for name, (theirs, ours, reference) in products(args.rows, k, n).items():
            ref = reference()
            stats = alternate({"torch": theirs, "onednn": ours}, args.repeats, warmup=1)
            all_stats.update({f"{k}x{n} {name} {lib}": st for lib, st in stats.items()})
            t_torch, t_onednn = stats["torch"].min, stats["onednn"].min
            rows.append(
                {
                    "layer": f"{k}x{n}",
                    "product": name,
                    "torch_gflops": round(flops / t_torch / 1e9, 1),
                    "onednn_gflops": round(flops / t_onednn / 1e9, 1),
                    "speedup": round(t_torch / t_onednn, 2),
                    "torch_max_err": float((theirs().double() - ref).abs().max()),
                    "onednn_max_err": float((ours().double() - ref).abs().max()),
                }
            )
    return all_stats, {"threads": args.threads, "rows": args.rows, "products": rows}


def main(argv=None) -> None:
    report = Report("cpu_gemm", argv=argv)
    args = parse(argv)
    stats, result = run(args)
    print(
        f"{'layer':>10} {'product':>12} {'torch GFLOP/s':>14} {'oneDNN GFLOP/s':>15} {'oneDNN/torch':>13} "
        f"{'max |err| torch / oneDNN':>26}"
    )
    for r in result["products"]:
        print(
            f"{r['layer']:>10} {r['product']:>12} {r['torch_gflops']:14.1f} {r['onednn_gflops']:15.1f} "
            f"{r['speedup']:12.2f}x {r['torch_max_err']:12.2e} / {r['onednn_max_err']:.2e}"
        )
    report.emit(stats, results=args.results, **result)


if __name__ == "__main__":
    main()
