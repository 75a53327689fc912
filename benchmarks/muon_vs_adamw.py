"""Muon vs AdamW on the README's main job data, and the offloaded Muon step vs the offloaded Adam step on CPU.

    python -m benchmarks.muon_vs_adamw [--updates 120] [--part quality|step|both] [--corpus DIR]

quality: the main job's corpus (``examples/language_model/wikitext.sh``: ../shared/data/wikitext-2-mini) and
model family (transformer_lm, pre-norm, tied embeddings, 2 layers), smaller so that six runs take minutes on
two loaded CPU cores (width 64, FFN 256, B 8 x T 64, no dropout), trained for the same ``--updates`` with the
same schedule (inverse_sqrt, warm-up a quarter of the updates, --clip-norm 1) by ``toolkit-train --optimizer
adam`` and ``--optimizer muon``, each at three learning rates; Muon's AdamW side (embeddings, norms, biases)
takes AdamW's best rate, so only the blocks' matrices are updated differently. Prints every run's validation perplexity and each optimizer's best.

step: one optimizer step over a transformer's parameters (4 blocks of width 512: matrices and vectors, random
gradients) in host memory, what ``--cpu-offload`` updates: ``--optimizer muon`` (Newton-Schulz on the CPU, no
GPU here; fp32 and ``--muon-momentum-dtype bf16``; on a GPU machine the matrices go through the pinned, overlapped
staging instead, so that figure is the GPU's: ``gpu.sh muon_offload_llama3_1b``) against DeepSpeed's CPU Adam (``--optimizer cpu_adam``); alternated rounds (:func:`benchmarks.timing.alternate`),
the minimum reported.

The last line is one JSON object (``"benchmark": "muon_vs_adamw"``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

from benchmarks.timing import REPO, Report, add_results_flag, alternate, time_call

MODEL = [
    "--task",
    "language_modeling",
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
    "--decoder-input-dim",
    "64",
    "--decoder-output-dim",
    "64",
    "--decoder-normalize-before",
    "--share-decoder-input-output-embed",
    "--dropout",
    "0",
    "--tokens-per-sample",
    "64",
    "--batch-size",
    "8",
    "--adam-betas",
    "(0.9, 0.98)",
    "--lr-scheduler",
    "inverse_sqrt",
    "--warmup-init-lr",
    "1e-07",
    "--clip-norm",
    "1.0",
    "--log-format",
    "json",
    "--log-interval",
    "1000",
    "--no-save",
    "--cpu",
    "--num-workers",
    "0",
    "--seed",
    "1",
]
ADAM_LRS = (1e-3, 3e-3, 1e-2)
MUON_LRS = (0.01, 0.02, 0.05)


def toolkit(command: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", f"toolkit_cli.{command}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    if proc.returncode != 0:
        raise SystemExit(f"{command} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout + proc.stderr


def valid_ppl(log: str) -> float:
    values = [json.loads(m.group(1)) for m in re.finditer(r"\| valid \| (\{.*\})", log)]
    return float(values[-1]["valid_ppl"])


def quality(corpus: str, updates: int, adamw_best=None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "bin")
        toolkit(
            "preprocess",
            "--only-source",
            "--trainpref",
            f"{corpus}/wiki.train.tokens",
            "--validpref",
            f"{corpus}/wiki.valid.tokens",
            "--destdir",
            data,
            "--workers",
            "1",
        )
        common = MODEL + [
            "--max-update",
            str(updates),
            "--warmup-updates",
            str(max(1, updates // 4)),
            "--validate-interval-updates",
            str(updates),
        ]
        runs: dict = {}

        def grid(name, lrs, extra):
            for lr in lrs:
                seconds, log = time_call(lambda: toolkit("train", data, *common, *extra, "--lr", str(lr)))
                runs[(name, lr)] = ppl = valid_ppl(log)
                print(f"{name:6s} lr {lr:<7g} valid ppl {ppl:8.2f}   ({seconds:.0f} s)", flush=True)

        if adamw_best is None:
            grid("adamw", ADAM_LRS, ["--optimizer", "adam"])
            adamw_best = min((v, lr) for (n, lr), v in runs.items() if n == "adamw")[1]
        # Muon's AdamW side (embeddings, head, norms, biases) at AdamW's best rate: only the matrices differ
        grid("muon", MUON_LRS, ["--optimizer", "muon", "--muon-adamw-lr", str(adamw_best)])
    best = {
        name: min(v for (n, _), v in runs.items() if n == name)
        for name in ("adamw", "muon")
        if any(n == name for n, _ in runs)
    }
    print(
        f"best of 3 after {updates} updates: "
        + ", ".join(f"{n} {v:.2f}" for n, v in best.items())
        + f" (Muon's AdamW side at lr {adamw_best:g})"
    )
    return {
        "updates": updates,
        "runs": {f"{n} lr {lr:g}": v for (n, lr), v in runs.items()},
        "best": best,
        "muon_adamw_lr": adamw_best,
    }


def transformer_params(dim: int = 512, blocks: int = 4):
    g = torch.Generator().manual_seed(0)
    shapes = (
        [(3 * dim, dim), (dim, dim), (4 * dim, dim), (dim, 4 * dim)] * blocks,
        [(3 * dim,), (dim,), (4 * dim,), (dim,), (dim,), (dim,), (dim,), (dim,)] * blocks,
    )
    out = []
    for role_shapes in shapes:
        ps = []
        for s in role_shapes:
            p = torch.nn.Parameter(torch.empty(s).normal_(0, 0.02, generator=g))
            p.grad = torch.empty(s).normal_(0, 1e-3, generator=g)
            ps.append(p)
        out.append(ps)
    return out


def step_times(rounds: int = 5):
    from toolkit.optim.cpu_adam import CPUAdam
    from toolkit.optim.muon import Muon, newton_schulz

    matrices, vectors = transformer_params()
    opts = {
        "muon": Muon(
            [{"params": matrices, "role": "matrix"}, {"params": vectors, "role": "norm"}], lr=0.02, weight_decay=0.01
        )
    }
    matrices, vectors = transformer_params()
    opts["muon_bf16_momentum"] = Muon(
        [{"params": matrices, "role": "matrix"}, {"params": vectors, "role": "norm"}],
        lr=0.02,
        weight_decay=0.01,
        momentum_dtype=torch.bfloat16,
    )
    matrices, vectors = transformer_params()
    opts["cpu_adam"] = CPUAdam(matrices + vectors, lr=1e-3, weight_decay=0.01)
    numel = sum(p.numel() for p in matrices + vectors)
    steps = {name: opt.step for name, opt in opts.items()}
    steps["newton_schulz_only"] = lambda: [newton_schulz(p.grad, 5) for p in matrices]  # muon's share of it
    stats = alternate(steps, rounds, warmup=1)  # the warm-up round allocates the state
    best = {k: st.min * 1e3 for k, st in stats.items()}
    print(
        f"host-memory step over {numel / 1e6:.1f}M parameters ({torch.get_num_threads()} threads): "
        f"muon {best['muon']:.1f} ms (of which Newton-Schulz {best['newton_schulz_only']:.1f} ms; bf16 momentum "
        f"{best['muon_bf16_momentum']:.1f} ms), cpu_adam {best['cpu_adam']:.1f} ms"
    )
    return stats, {"params": numel, "threads": torch.get_num_threads(), "ms": best}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--updates", type=int, default=120)
    ap.add_argument("--part", choices=["quality", "step", "both"], default="both")
    ap.add_argument(
        "--adamw-best-lr",
        type=float,
        default=None,
        help="skip the AdamW grid: its best rate from an earlier run (Muon's AdamW side uses it)",
    )
    ap.add_argument("--corpus", default=os.path.join(REPO, "..", "shared", "data", "wikitext-2-mini"))
    ap.add_argument("--rounds", type=int, default=5, help="step: timed rounds of each optimizer (alternated)")
    add_results_flag(ap)
    args = ap.parse_args(argv)
    report = Report("muon_vs_adamw", argv=argv)
    result, stats = {}, None
    if args.part in ("step", "both"):
        stats, result["step"] = step_times(args.rounds)
    if args.part in ("quality", "both"):
        result["quality"] = quality(args.corpus, args.updates, args.adamw_best_lr)
    report.emit(stats, "cpu_adam" if stats else None, args.results, **result)


if __name__ == "__main__":
    main()
