"""Forward + backward of one attention layer: the fused q/k/v ``view/permute/unbind`` layout vs ``split``.

    python -m benchmarks.attention_layout                       # C 768, 12 heads, B 8 x T 512, fp32, CPU
    python -m benchmarks.attention_layout --dim 2048 --heads 32 --batch 4 --tokens 2048 --device cuda --dtype bf16

``old``: ``qkv.view(B, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)`` (the model's layout before issue 15).
Its backward stacks the three q/k/v gradients into [3, B, H, T, D] and copies that, strided,
into the [B, T, 3C] gradient of the projection.
``new``: ``qkv.split([C, C, C], -1)`` then ``view(B, T, H, D).transpose(1, 2)`` per tensor (the model's
``CausalSelfAttention``). SDPA's gradients come back in [B, T, H, D] memory order, so the views
undo for free and split's backward is a single concatenation.

Both run on the same weights; the script checks their outputs and gradients agree, times
``--steps`` forward+backward passes of each (alternated after a warm-up, :func:`benchmarks.timing.alternate`), and counts the copy kernels
(``aten::copy_``, ``cat``, ``stack``, ``clone``, ``contiguous``) that one backward launches and
their summed self time, by torch.profiler (the median of 3 profiled backwards). Prints a table and
one JSON line (``"benchmark": "attention_layout"``).
"""

from __future__ import annotations

import argparse
from typing import Callable, Dict

import torch
import torch.nn.functional as F

from benchmarks.timing import Report, add_results_flag, alternate, median
from toolkit.models.transformer_lm import CausalSelfAttention, TransformerLMConfig

COPY_KERNELS = ("aten::copy_", "aten::cat", "aten::stack", "aten::clone", "aten::contiguous")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def old_layout(attn: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    B, T, _ = x.shape
    q, k, v = attn.qkv_proj(x).view(B, T, 3, -1, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attn.out_proj(y.transpose(1, 2).flatten(2))


def new_layout(attn: CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    return attn(x)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=768, help="C, the model width (default 768)")
    ap.add_argument("--heads", type=int, default=12, help="H (default 12)")
    ap.add_argument("--batch", type=int, default=8, help="B (default 8)")
    ap.add_argument("--tokens", type=int, default=512, help="T (default 512)")
    ap.add_argument("--steps", type=int, default=10, help="timed passes of each layout (default 10)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="parameter and input dtype")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    add_results_flag(ap)
    return ap.parse_args(argv)


def build(args) -> CausalSelfAttention:
    torch.manual_seed(0)
    cfg = TransformerLMConfig(decoder_embed_dim=args.dim, decoder_attention_heads=args.heads)
    attn = CausalSelfAttention(cfg).to_empty(device=args.device)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, args.dim**-0.5)
    return attn.to(DTYPES[args.dtype])


def one_pass(fn: Callable, attn, x: torch.Tensor, grad: torch.Tensor) -> None:
    attn.zero_grad(set_to_none=True)
    x.grad = None
    fn(attn, x).backward(grad)


def backward_copy_kernels(fn: Callable, attn, x: torch.Tensor, grad: torch.Tensor, runs: int = 3) -> Dict[str, float]:
    """How many times one backward calls each copy kernel, and their summed self time in ms, the median
    of ``runs`` (torch.profiler; self times, so ``stack`` calling ``cat`` is not counted twice; kernel
    time on a GPU, host time on CPU)."""
    from torch.profiler import profile

    times = []
    for _ in range(runs):
        y = fn(attn, x)
        with profile() as prof:
            y.backward(grad)
        events = {e.key: e for e in prof.key_averages()}
        attr = "self_device_time_total" if x.is_cuda else "self_cpu_time_total"
        times.append(sum(getattr(events[k], attr) for k in COPY_KERNELS if k in events) / 1e3)
    out: Dict[str, float] = {k: events[k].count if k in events else 0 for k in COPY_KERNELS}
    out["self_ms"] = median(times)
    return out


def check_agreement(attn, x: torch.Tensor, grad: torch.Tensor) -> float:
    """Largest relative difference between the layouts over the output and the gradients."""
    results = []
    for fn in (old_layout, new_layout):
        attn.zero_grad(set_to_none=True)
        x.grad = None
        y = fn(attn, x)
        y.backward(grad)
        results.append([y.detach().float(), x.grad.float()] + [p.grad.float() for p in attn.parameters()])
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(*results))


def main(argv=None) -> None:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = Report("attention_layout", device=args.device, argv=argv)
    attn = build(args)
    dtype = DTYPES[args.dtype]
    x = torch.randn(args.batch, args.tokens, args.dim, device=args.device, dtype=dtype, requires_grad=True)
    grad = torch.randn(args.batch, args.tokens, args.dim, device=args.device, dtype=dtype)
    rel = check_agreement(attn, x, grad)
    layouts = {"old": old_layout, "new": new_layout}
    passes = {name: lambda fn=fn: one_pass(fn, attn, x, grad) for name, fn in layouts.items()}
    stats = alternate(passes, args.steps, warmup=1, device=args.device)
    copies = {name: backward_copy_kernels(fn, attn, x, grad) for name, fn in layouts.items()}
    median_ms = {name: st.median * 1e3 for name, st in stats.items()}
    print(
        f"attention layer C {args.dim}, H {args.heads}, B {args.batch} x T {args.tokens}, {args.dtype}, "
        f"{args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"max relative difference old/new {rel:.1e}"
    )
    print(f"{'layout':<8}{'fwd+bwd ms (median)':>21}{'best ms':>10}  backward copy kernels")
    for name in layouts:
        kernels = ", ".join(f"{k.split('::')[1]} {n}" for k, n in copies[name].items() if k in COPY_KERNELS)
        kernels += f"; {copies[name]['self_ms']:.2f} ms"
        print(f"{name:<8}{median_ms[name]:>21.2f}{stats[name].min * 1e3:>10.2f}  {kernels}")
    report.emit(
        stats,
        baseline="old",
        results=args.results,
        dim=args.dim,
        heads=args.heads,
        batch=args.batch,
        tokens=args.tokens,
        dtype=args.dtype,
        max_rel_diff=rel,
        median_ms=median_ms,
        backward_copy_kernels=copies,
    )


if __name__ == "__main__":
    main()
