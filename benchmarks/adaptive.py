"""Adaptive softmax (+ adaptive input) against a full softmax on a WikiText-103-sized vocabulary (CPU).

    python -m benchmarks.adaptive [--vocab 267744] [--layers 2] [--embed-dim 256] [--ffn-dim 1024]
        [--heads 4] [--batch-size 2] [--tokens-per-sample 128] [--steps 4] [--warmup 1] [--threads 2]
        [--configs full,adaptive_softmax,adaptive] [--json]

The model is transformer_lm_wiki103 scaled down to run on a CPU (2 layers, C=256; cutoffs
20000,60000 and the wiki103 arch's tying), built by toolkit's own code, on a synthetic vocabulary
of V=267,744 whose token ids are drawn from Zipf's law (p(rank r) ~ 1/r), as a frequency-sorted
dictionary's are in real text: the adaptive softmax's cost depends on how many targets fall in
its tail bands, so uniform ids would misstate it. Configurations:

* ``full``: ``transformer_lm`` with a plain embedding and a full [C, V] softmax, ``cross_entropy``;
* ``adaptive_softmax``: the plain embedding with an (untied) adaptive softmax, ``adaptive_loss``;
* ``adaptive``: the same body with adaptive input and softmax (``--adaptive-input``,
  ``--tie-adaptive-weights --tie-adaptive-proj``), ``adaptive_loss``.

Every configuration runs in a fresh subprocess (its peak memory is its own; so its steps are timed in a row,
:func:`benchmarks.timing.repeat`, not alternated with the others'). Per configuration:

* **tokens/s** of a training step (forward, backward, fused AdamW step): the fastest of ``--steps``
  steps after ``--warmup`` (the least disturbed by other processes on a shared machine), and
  **tokens per CPU-second** (median, ``timing.cpu_now``: what the step costs, whatever the
  contention);
* **output layer memory**: the output layer and loss alone (forward and backward from the final
  features, which are detached so nothing else is counted): the bytes of the tensors autograd
  saves plus their gradients' peak, measured as the peak RSS growth over that step, and the same
  counted analytically (logits, their log-softmax and gradient: 3 x rows x width x 4 bytes per
  scored block, rows being all positions for the head/full softmax and the band's for a tail);
* **peak RSS growth** of a whole training step (activations of the body included).

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from typing import Dict, List

from benchmarks.timing import REPO, Report, Stats, add_results_flag, cpu_now, median, module_argv, repeat

CUTOFF = "20000,60000"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def zipf_tokens(vocab: int, shape, seed: int):
    """Token ids 4..V-1 with p(id) ~ 1 / (id - 3), as a frequency-sorted dictionary's."""
    import torch

    ranks = torch.arange(1, vocab - 3, dtype=torch.float64)
    probs = (1.0 / ranks) / (1.0 / ranks).sum()
    g = torch.Generator().manual_seed(seed)
    n = int(torch.tensor(shape).prod())
    return (torch.multinomial(probs, n, replacement=True, generator=g) + 4).view(*shape)


def build(config: str, a):
    from types import SimpleNamespace

    from toolkit.models.transformer_lm import TransformerLanguageModel, TransformerLMConfig
    from toolkit.core.registry import CRITERION_REGISTRY, import_all_components

    import_all_components()
    common = dict(
        decoder_layers=a.layers,
        decoder_embed_dim=a.embed_dim,
        decoder_ffn_embed_dim=a.ffn_dim,
        decoder_attention_heads=a.heads,
        max_target_positions=a.tokens_per_sample,
        dropout=0.0,
        no_decoder_final_norm=True,
    )
    if config == "adaptive":
        cfg = TransformerLMConfig(
            **common,
            adaptive_input=True,
            adaptive_input_cutoff=CUTOFF,
            adaptive_softmax_cutoff=CUTOFF,
            tie_adaptive_weights=True,
            tie_adaptive_proj=True,
        )
        criterion_name = "adaptive_loss"
    elif config == "adaptive_softmax":
        cfg = TransformerLMConfig(**common, adaptive_softmax_cutoff=CUTOFF)
        criterion_name = "adaptive_loss"
    else:
        cfg = TransformerLMConfig(**common)
        criterion_name = "cross_entropy"
    model = TransformerLanguageModel(cfg, a.vocab, 1, seed=1)
    task = SimpleNamespace(target_dictionary=SimpleNamespace(pad=lambda: 1))
    return model, CRITERION_REGISTRY.get(criterion_name).cls(task)


def analytic_output_bytes(config: str, target, a) -> int:
    """Logits, their log-softmax and their gradient, fp32, of the output layer's scored blocks."""
    rows = target.numel()
    if not config.startswith("adaptive"):
        return 3 * 4 * rows * a.vocab
    edges = [0, 20000, 60000, a.vocab]
    total = 3 * 4 * rows * (edges[1] + 2)  # head: words + 2 clusters
    for lo, hi in zip(edges[1:], edges[2:]):
        total += 3 * 4 * int(((target >= lo) & (target < hi)).sum()) * (hi - lo)
    return total


def output_layer_step(model, criterion, features, sample) -> int:
    """Peak RSS growth of the output layer + loss alone (forward and backward from detached features)."""

    x = features.detach().requires_grad_(True)
    before = rss_bytes()
    if model.adaptive_softmax is not None:
        loss = model.adaptive_softmax.loss(x, sample["target"], 1)
    else:
        loss = criterion.compute_loss(model.output_projection(x), sample["target"])
    loss.backward()
    del loss
    return max(0, peak_rss_bytes() - before), x


def measure(config: str, a) -> Dict[str, float]:
    import torch

    from toolkit.train.trainer import forward_and_loss

    torch.set_num_threads(a.threads)
    model, criterion = build(config, a)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = zipf_tokens(a.vocab, (a.batch_size, a.tokens_per_sample + 1), seed=0)
    sample = {"net_input": {"src_tokens": tokens[:, :-1]}, "target": tokens[:, 1:], "ntokens": tokens[:, 1:].numel()}
    # the output layer alone, first (so its peak RSS is not hidden under the whole step's)
    with torch.no_grad():
        features = _features(model, sample)
    output_rss, _ = output_layer_step(model, criterion, features, sample)
    model.zero_grad(set_to_none=True)
    cpu_times: List[float] = []
    step_rss = 0

    def step():
        nonlocal step_rss
        before, cpu_start = rss_bytes(), cpu_now()
        loss, _, _ = forward_and_loss(model, criterion, sample)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        cpu_times.append(cpu_now() - cpu_start)
        step_rss = max(step_rss, peak_rss_bytes() - before)
        return loss

    stats = repeat(step, a.steps, a.warmup)
    n_tokens = sample["ntokens"]
    return {
        "config": config,
        "params": sum(p.numel() for p in model.parameters()),
        "seconds": stats.seconds,
        "tokens_per_s": n_tokens / stats.min,
        "step_ms": 1e3 * stats.min,
        "median_step_ms": 1e3 * stats.median,
        "tokens_per_cpu_s": n_tokens / median(cpu_times[a.warmup :]),
        "output_layer_rss_mb": output_rss / 2**20,
        "output_layer_analytic_mb": analytic_output_bytes(config, sample["target"], a) / 2**20,
        "step_peak_rss_growth_mb": step_rss / 2**20,
        "loss": float(stats.last),
    }


def _features(model, sample):
    """The final features the output layer sees (the model's forward without its output layer)."""
    asm, proj = model.adaptive_softmax, model.output_projection
    if asm is not None:
        return model(sample["net_input"]["src_tokens"])
    captured = {}
    handle = proj.register_forward_pre_hook(lambda m, args: captured.setdefault("x", args[0]))
    model(sample["net_input"]["src_tokens"])
    handle.remove()
    return captured["x"]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=267744)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--embed-dim", type=int, default=256)
    p.add_argument("--ffn-dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--tokens-per-sample", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", default="full,adaptive_softmax,adaptive")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    add_results_flag(p)
    return p.parse_args(argv)


def main() -> None:
    a = parse()
    if a.child:
        print(json.dumps(measure(a.child, a)))
        return
    report = Report("adaptive_softmax")
    results, stats = {}, {}
    for config in a.configs.split(","):
        argv = [*module_argv("adaptive"), *sys.argv[1:], "--child", config]
        env = dict(os.environ, TOOLKIT_KEEP_CPU_MEMORY="0")
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO)
        if proc.returncode != 0:
            raise SystemExit(f"{config} failed:\n{proc.stderr[-3000:]}")
        results[config] = json.loads(proc.stdout.strip().splitlines()[-1])
        stats[config] = Stats(results[config].pop("seconds"))
    if "full" in results and "adaptive" in results:
        f, ad = results["full"], results["adaptive"]
        results["speedup"] = ad["tokens_per_s"] / f["tokens_per_s"]
        results["speedup_cpu_time"] = ad["tokens_per_cpu_s"] / f["tokens_per_cpu_s"]
        results["output_layer_memory_ratio_rss"] = ad["output_layer_rss_mb"] / max(f["output_layer_rss_mb"], 1e-9)
        results["output_layer_memory_ratio_analytic"] = ad["output_layer_analytic_mb"] / f["output_layer_analytic_mb"]
    results["load_average"] = os.getloadavg()[0]
    if not a.json:
        print(
            f"V={a.vocab:,}, {a.layers} layers, C={a.embed_dim}, B={a.batch_size} x T={a.tokens_per_sample}, "
            f"{a.threads} threads (load average {results['load_average']:.1f})"
        )
        print(
            f"{'config':16} {'params':>12} {'tokens/s':>10} {'step ms':>9} {'tok/CPU-s':>10} {'out RSS MB':>11} "
            f"{'out analytic MB':>16} {'step RSS MB':>12}"
        )
        for name in a.configs.split(","):
            r = results[name]
            print(
                f"{name:16} {r['params']:>12,} {r['tokens_per_s']:>10.1f} {r['step_ms']:>9.0f} "
                f"{r['tokens_per_cpu_s']:>10.1f} "
                f"{r['output_layer_rss_mb']:>11.1f} {r['output_layer_analytic_mb']:>16.1f} "
                f"{r['step_peak_rss_growth_mb']:>12.1f}"
            )
        if "speedup" in results:
            print(
                f"adaptive vs full: {results['speedup']:.2f}x tokens/s (fastest step), "
                f"{results['speedup_cpu_time']:.2f}x tokens per CPU-second; output layer memory "
                f"{results['output_layer_memory_ratio_rss']:.3f} (RSS), "
                f"{results['output_layer_memory_ratio_analytic']:.3f} (analytic)"
            )
    report.emit(stats, "full" if "full" in stats else None, a.results, **results)


if __name__ == "__main__":
    main()
