"""cpu_adam's Adam moments in fp32, bf16 and 8 bits: training parity and host bytes per parameter.

    python -m benchmarks.adam_states                    # memory, speed and parity
    python -m benchmarks.adam_states parity [--updates 500] [--workdir /tmp/adam_states]
    python -m benchmarks.adam_states memory
    python -m benchmarks.adam_states speed [--speed-runs fp32 8bit] [--rounds 5]
    python -m benchmarks.adam_states codes

``parity``: toolkit-train (a subprocess, the real CLI path) on the shared WikiText-2 mini
corpus (preprocessed once into ``--workdir``), a small transformer_lm on CPU, ``--optimizer
cpu_adam`` with ``--adam-state-precision fp32 | bf16 | 8bit``, and 8bit with ``--bf16-host-grads``
(under ``--ddp-backend fully_sharded --cpu-offload`` in one process): the same seed, data order
and dropout, ``--updates`` updates each. Reports the training loss of the last log interval
(updates 451-500 by default) and the final validation loss of each run, and their relative
difference to the fp32 run (issue 15's bar: within 1%).

``memory``: host bytes per parameter held for training under ``--cpu-offload``: the fp32
parameters, their gradients (fp32, or bf16 with ``--bf16-host-grads``) and the optimizer's
state tensors (and, for the measured model, the time of one optimizer step). Measured as the sizes
of the tensors a CPUAdam actually holds after one step on a mid-size transformer_lm (built
in host memory, random gradients), and projected from the shapes of
``transformer_lm_gpt3_13`` (built on the meta device) with the same per-shape accounting
(``quantized_states.state_nbytes``), which the measured figures check.

``speed``: ``CPUAdam.step()`` per moment layout on the same model, the layouts alternated
(:func:`benchmarks.timing.alternate`). ``codes``: the fused 8-bit kernel's encoder against the eager one on
every fp32 ratio in (0, 1]. Each part prints its table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from typing import Dict, List

import torch

from benchmarks.timing import REPO, Report, add_results_flag, alternate, time_call

CORPUS = os.path.join(REPO, "..", "shared", "data", "wikitext-2-mini")
PRECISIONS = ("fp32", "bf16", "8bit")
# (moments, host gradients): --adam-state-precision, and --bf16-host-grads or not
CONFIGS = (
    ("fp32", torch.float32),
    ("bf16", torch.float32),
    ("8bit", torch.float32),
    ("bf16", torch.bfloat16),
    ("8bit", torch.bfloat16),
)
LOG_LINE = re.compile(r"^\S+ \S+ \| \w+ \| ([\w.]+) \| (\{.*\})$")
MODEL = [
    "--arch",
    "transformer_lm",
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "64",
    "--decoder-ffn-embed-dim",
    "256",
    "--decoder-attention-heads",
    "4",
    "--dropout",
    "0.1",
    "--share-decoder-input-output-embed",
    "--tokens-per-sample",
    "64",
    "--batch-size",
    "8",
    "--optimizer",
    "cpu_adam",
    "--adam-betas",
    "(0.9, 0.98)",
    "--weight-decay",
    "0.01",
    "--lr",
    "0.002",
    "--lr-scheduler",
    "inverse_sqrt",
    "--warmup-updates",
    "100",
    "--clip-norm",
    "1.0",
    "--cpu",
    "--num-workers",
    "0",
    "--seed",
    "1",
    "--log-format",
    "json",
    "--log-interval",
    "50",
    "--no-save",
    "--validate-interval-updates",
    "0",
]


def _env() -> Dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))


def preprocess(workdir: str) -> str:
    """WikiText-2 mini as a data-bin (the 4,000 most frequent words), once."""
    dest = os.path.join(workdir, "wikitext-2-mini-4k")
    if not os.path.exists(os.path.join(dest, "dict.txt")):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "toolkit_cli.preprocess",
                "--only-source",
                "--nwordssrc",
                "4000",
                "--trainpref",
                os.path.join(CORPUS, "wiki.train.tokens"),
                "--validpref",
                os.path.join(CORPUS, "wiki.valid.tokens"),
                "--destdir",
                dest,
            ],
            check=True,
            env=_env(),
            cwd=REPO,
            stdout=subprocess.DEVNULL,
        )
    return dest


# name -> flags: the moments' precision, and the 13B recipe's pair (one process under FSDP2: the same numbers)
RUNS = {
    "fp32": ["--adam-state-precision", "fp32"],
    "bf16": ["--adam-state-precision", "bf16"],
    "8bit": ["--adam-state-precision", "8bit"],
    "8bit+bf16-grads": [
        "--adam-state-precision",
        "8bit",
        "--ddp-backend",
        "fully_sharded",
        "--cpu-offload",
        "--bf16-host-grads",
    ],
}


def train_run(data: str, name: str, updates: int) -> Dict[str, float]:
    """One toolkit-train run; its last train_inner loss and its last valid loss."""
    seconds, proc = time_call(
        lambda: subprocess.run(
            [sys.executable, "-m", "toolkit_cli.train", data, *MODEL, "--max-update", str(updates), *RUNS[name]],
            capture_output=True,
            text=True,
            env=_env(),
            cwd=REPO,
        )
    )
    if proc.returncode != 0:
        raise SystemExit(f"toolkit-train ({name}) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    records: Dict[str, List[dict]] = {}
    for line in proc.stdout.splitlines():
        m = LOG_LINE.match(line)
        if m:
            records.setdefault(m.group(1), []).append(json.loads(m.group(2)))
    last = records["train_inner"][-1]
    return {
        "train_loss": float(last["loss"]),
        "at_update": int(last["num_updates"]),
        "valid_loss": float(records["valid"][-1]["valid_loss"]),
        "seconds": round(seconds, 1),
    }


def parity(args) -> Dict[str, Dict[str, float]]:
    report = Report("adam_states_parity")
    data = preprocess(args.workdir)
    results = {}
    for name in args.runs:
        results[name] = train_run(data, name, args.updates)
        print(f"  {name}: {results[name]}", flush=True)
    if "fp32" not in results:
        report.emit(results=args.results, updates=args.updates, runs=results)
        return results
    ref = results["fp32"]
    print(f"\n{args.updates} updates, {' '.join(MODEL)}\n")
    print("| moments | train loss (last 50 updates) | vs fp32 | valid loss | vs fp32 | wall s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for precision, r in results.items():
        dt = (r["train_loss"] - ref["train_loss"]) / ref["train_loss"]
        dv = (r["valid_loss"] - ref["valid_loss"]) / ref["valid_loss"]
        print(
            f"| {precision} | {r['train_loss']:.3f} | {dt:+.2%} | {r['valid_loss']:.3f} | {dv:+.2%} | {r['seconds']} |"
        )
    report.emit(results=args.results, updates=args.updates, runs=results)
    return results


# --------------------------------------------------------------------------- memory


def _nbytes(t: torch.Tensor) -> int:
    from toolkit.core.dtensor import local_tensor

    t = local_tensor(t)
    return t.numel() * t.element_size()


MID = dict(decoder_layers=6, decoder_embed_dim=512, decoder_ffn_embed_dim=2048, decoder_attention_heads=8)


def host_params(grad_dtype: torch.dtype, arch_overrides: Dict[str, int], vocab: int) -> List[torch.Tensor]:
    """A transformer_lm's parameters in host memory (random), each with a random gradient of ``grad_dtype``."""
    from toolkit.core import registry
    from toolkit.models import build_on_meta

    registry.import_all_components()  # the families register themselves on import
    model = build_on_meta("transformer_lm", vocab, 512, **arch_overrides).to_empty(device="cpu")
    params = list({id(p): p for p in model.parameters()}.values())
    g = torch.Generator().manual_seed(0)
    for p in params:
        with torch.no_grad():
            p.normal_(0, 0.02, generator=g)
        p.grad_dtype = None  # what --bf16-host-grads sets, so that a bf16 gradient may be assigned
        p.grad = torch.empty_like(p).normal_(0, 1e-3, generator=g).to(grad_dtype)
    return params


def measured(precision: str, grad_dtype: torch.dtype, arch_overrides: Dict[str, int], vocab: int) -> Dict[str, float]:
    """Bytes per parameter of the tensors a CPUAdam holds after one step on a host-memory model."""
    from toolkit.optim import quantized_states
    from toolkit.optim.cpu_adam import CPUAdam

    params = host_params(grad_dtype, arch_overrides, vocab)
    opt = CPUAdam(params, lr=1e-4, betas=(0.9, 0.98), adam_state_precision=precision)
    opt.step()  # creates the state
    seconds, _ = time_call(opt.step)
    n = sum(p.numel() for p in params)
    state = sum(_nbytes(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    projected = sum(quantized_states.state_nbytes(precision, p.shape) + 4 for p in params)  # + the step scalar
    return {
        "params": n,
        "weights": sum(_nbytes(p) for p in params) / n,
        "grads": sum(_nbytes(p.grad) for p in params) / n,
        "state": state / n,
        "state_by_shapes": projected / n,
        "step_s": seconds,
    }


def projected(precision: str, grad_dtype: torch.dtype, arch: str) -> Dict[str, float]:
    from toolkit.core import registry
    from toolkit.models import build_on_meta
    from toolkit.optim import quantized_states

    registry.import_all_components()
    model = build_on_meta(arch)
    params = list({id(p): p for p in model.parameters()}.values())
    n = sum(p.numel() for p in params)
    state = sum(quantized_states.state_nbytes(precision, p.shape) for p in params)
    grad_bytes = torch.empty((), dtype=grad_dtype).element_size()
    return {"params": n, "weights": 4.0, "grads": float(grad_bytes), "state": state / n}


def memory(args) -> None:
    report = Report("adam_states_memory")
    mid = MID
    rows = []
    print(
        "| model | params | moments | host grads | weights B/param | grads B/param | optimizer state B/param "
        "| total B/param | total host memory | step s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, fn in (
        ("transformer_lm 6x512 V 32000 (measured)", lambda p, d: measured(p, d, mid, 32000)),
        ("transformer_lm_gpt3_13 V 50257 (projected)", lambda p, d: projected(p, d, "transformer_lm_gpt3_13")),
    ):
        for precision, grad_dtype in CONFIGS:
            r = fn(precision, grad_dtype)
            total = r["weights"] + r["grads"] + r["state"]
            check = f" (by shapes {r['state_by_shapes']:.3f})" if "state_by_shapes" in r else ""
            grads = "bf16" if grad_dtype == torch.bfloat16 else "fp32"
            rows.append({"model": label, "moments": precision, "host_grads": grads, **r, "total": total})
            print(
                f"| {label} | {r['params'] / 1e6:,.1f}M | {precision} | {grads} | {r['weights']:.2f} | "
                f"{r['grads']:.2f} | {r['state']:.3f}{check} | {total:.2f} | "
                f"{total * r['params'] / 2**30:.1f} GiB | {r.get('step_s', float('nan')):.2f} |",
                flush=True,
            )
    report.emit(results=args.results, rows=rows)


# --------------------------------------------------------------------------- speed

SPEED_RUNS = {  # name -> (--adam-state-precision, host gradient dtype, the fused 8-bit kernel)
    "fp32": ("fp32", torch.float32, True),
    "bf16": ("bf16", torch.float32, True),
    "8bit": ("8bit", torch.float32, True),
    "8bit eager": ("8bit", torch.float32, False),
    "bf16 +bf16 grads": ("bf16", torch.bfloat16, True),
    "8bit +bf16 grads": ("8bit", torch.bfloat16, True),
    "8bit eager +bf16 grads": ("8bit", torch.bfloat16, False),
}


def speed(args) -> Dict[str, Dict[str, float]]:
    """CPUAdam.step() time on the 51.7M-parameter model per moment layout, rounds interleaved across layouts
    (a noisy neighbour hits all alike); the same parameters and gradients for each, untimed first steps."""
    from toolkit.optim.cpu_adam import CPUAdam

    if args.threads:
        torch.set_num_threads(args.threads)
    report = Report("adam_states_speed")
    runs = {}
    for name in args.speed_runs:
        precision, grad_dtype, fused = SPEED_RUNS[name]
        params = host_params(grad_dtype, MID, 32000)
        opt = CPUAdam(params, lr=1e-4, betas=(0.9, 0.98), weight_decay=0.01, adam_state_precision=precision)
        if opt.moments is not None and not fused:
            opt.moments.fused = None  # the eager codec (the fallback without a compiler)
        runs[name] = opt
    n = sum(p.numel() for p in runs[args.speed_runs[0]].param_groups[0]["params"])
    stats = alternate({name: opt.step for name, opt in runs.items()}, args.rounds, args.warmup)
    print(
        f"\nCPUAdam.step() on transformer_lm 6x512 V 32000 ({n / 1e6:.1f}M params), {torch.get_num_threads()} "
        f"threads, {args.rounds} rounds\n"
    )
    print("| moments (host grads, codec) | step s, median | best | median vs fp32 |")
    print("| --- | --- | --- | --- |")
    results = {name: {"median_s": st.median, "best_s": st.min} for name, st in stats.items()}
    ref = results.get("fp32", {}).get("median_s")
    for name, r in results.items():
        rel = f"{r['median_s'] / ref:.2f}x" if ref else ""
        print(f"| {name} | {r['median_s']:.3f} | {r['best_s']:.3f} | {rel} |")
    report.emit(stats, "fp32" if "fp32" in stats else None, args.results, params=n, rows=results)
    return results


# --------------------------------------------------------------------------- codes


def codes() -> None:
    """The fused kernel's exp_avg_sq encoder against the eager one on every fp32 ratio ``v / vmax`` in (0, 1]
    (and, for the record, how many of them the log2 formula of before the tables coded otherwise)."""
    from toolkit.optim import fused_8bit
    from toolkit.optim import quantized_states as qs

    op = fused_8bit.fused_op()
    if op is None:
        raise SystemExit("codes: the fused 8-bit kernel could not be built (see the WARNING above)")
    one, chunk = 0x3F800000, 1 << 24

    def count():
        differ = formula_differ = 0
        for start in range(1, one + 1, chunk):
            ratio = torch.arange(start, min(start + chunk, one + 1), dtype=torch.int32).view(torch.float32)
            eager = qs.sq_code(ratio)
            differ += int((op.sq_codes(ratio, qs.SQ_RATIO, qs.SQ_THRESHOLD).int() != eager).sum())
            formula = ratio.log2().mul_(127.0 / qs.SQ_OCTAVES).round_().add_(255).clamp_(1, 255)
            formula_differ += int((formula.int() != eager).sum())
        return differ, formula_differ

    seconds, (differ, formula_differ) = time_call(count)
    print(
        f"codes: {one:,} fp32 ratios in (0, 1]: the fused encoder differs from the eager one on {differ}; "
        f"the log2 formula (torch's log2, before the tables) on {formula_differ} ({seconds:.0f} s)"
    )
    if differ:
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", nargs="?", choices=["parity", "memory", "speed", "codes", "all"], default="all")
    parser.add_argument("--updates", type=int, default=500)
    parser.add_argument("--workdir", default=os.path.join("/tmp", "adam_states"))
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), help="parity runs (default: all)")
    parser.add_argument(
        "--speed-runs",
        nargs="+",
        choices=list(SPEED_RUNS),
        default=list(SPEED_RUNS),
        help="speed: the layouts to time (default: all)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="speed: timed steps per layout (interleaved)")
    parser.add_argument("--warmup", type=int, default=2, help="speed: untimed steps per layout")
    parser.add_argument("--threads", type=int, default=None, help="speed: intra-op threads (default: torch's)")
    add_results_flag(parser)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
    if args.part in ("memory", "all"):
        memory(args)
    if args.part in ("speed", "all"):
        speed(args)
    if args.part == "codes":
        codes()
    if args.part in ("parity", "all"):
        parity(args)


if __name__ == "__main__":
    main()
