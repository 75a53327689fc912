"""Activation memory of a 12-layer transformer_lm with and without activation checkpointing (CPU).

    python -m benchmarks.memory [--layers 12] [--embed-dim 512] [--ffn-dim 2048] [--heads 8]
        [--tokens-per-sample 512] [--batch-size 4] [--vocab 8192] [--dtypes fp32,bf16]
        [--configs plain,checkpoint] [--threads 1] [--json]

Every configuration runs in a fresh subprocess, so that its peak RSS is its own. The model is
built and wrapped by toolkit's own code (``toolkit.distributed.parallelize.parallelize``:
``--checkpoint-activations`` wraps each block in torch's non-reentrant checkpoint wrapper),
then one training step's forward and backward run (cross-entropy summed in fp32, as the
trainer's criterion; ``--dtypes bf16`` runs forward under ``torch.autocast``, as ``--bf16``).

Two figures per configuration:

* saved activation bytes: what autograd keeps from the forward for the backward, counted
  with ``torch.autograd.graph.saved_tensors_hooks`` over unique storages, parameters
  excluded. With checkpointing this is each block's input (saved by the checkpoint) plus what
  the layers outside the blocks save (embeddings, final norm, output projection, loss).
* peak RSS growth: the process's ``ru_maxrss`` after the step minus its RSS just before the
  forward (model built, gradients already allocated): activations plus the backward's
  transient buffers (recomputed block activations included).

``--offload-activations`` (``save_on_cpu``) is not measured: on a CPU-only machine the saved
tensors are already in host memory (it only adds a copy); on a GPU it moves all of them to host.
The figures are printed as a table and one JSON line (``--json``: only the JSON line).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
from typing import Dict, List

from benchmarks.timing import REPO, Report, Stats, add_results_flag, module_argv, time_call


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measure(
    layers: int,
    embed_dim: int,
    ffn_dim: int,
    heads: int,
    tokens: int,
    batch: int,
    vocab: int,
    checkpoint: bool,
    dtype: str = "fp32",
    seed: int = 1,
) -> Dict[str, float]:
    """One forward+backward in this process; returns the figures of one configuration."""
    import torch
    import torch.nn.functional as F

    from toolkit.distributed.parallelize import parallelize
    from toolkit.distributed.utils import DistributedEnv
    from toolkit.models.transformer_lm import TransformerLanguageModel, TransformerLMConfig

    cfg = TransformerLMConfig(
        decoder_layers=layers,
        decoder_embed_dim=embed_dim,
        decoder_ffn_embed_dim=ffn_dim,
        decoder_attention_heads=heads,
        dropout=0.1,
        max_target_positions=tokens,
    )
    with torch.device("meta"):
        model = TransformerLanguageModel(cfg, vocab, padding_idx=1)
    from toolkit.config import CommonConfig, DistributedConfig

    distributed = DistributedConfig(ddp_backend="c10d", checkpoint_activations=checkpoint)
    common = CommonConfig(seed=seed, bf16=dtype == "bf16")
    model, parallel = parallelize(model, distributed, common, DistributedEnv())
    model.train()
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)  # allocated before the baseline: not activation memory
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    g = torch.Generator().manual_seed(seed)
    tokens_in = torch.randint(4, vocab, (batch, tokens), generator=g)
    target = torch.randint(4, vocab, (batch, tokens), generator=g)

    saved: Dict[int, int] = {}
    counting = [True]

    def pack(t):
        if counting[0]:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in param_storages:
                saved[ptr] = max(saved.get(ptr, 0), storage.nbytes())
        return t

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else torch.autocast("cpu", enabled=False)
    torch.manual_seed(seed)  # the same dropout masks in every configuration
    base = rss_bytes()

    def step():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            logits = model(tokens_in)
            loss = F.cross_entropy(logits.reshape(-1, vocab).float(), target.reshape(-1), reduction="sum")
        counting[0] = False
        loss.backward()
        return loss

    seconds, loss = time_call(step)
    return {
        "saved_activation_mb": sum(saved.values()) / 2**20,
        "peak_rss_growth_mb": max(0, peak_rss_bytes() - base) / 2**20,
        "step_seconds": seconds,
        "params_m": sum(p.numel() for p in params) / 1e6,
        "loss": float(loss.detach()) / (batch * tokens),
    }


def run_config(ns: argparse.Namespace, config: str, dtype: str) -> Dict[str, float]:
    """``measure`` in a fresh interpreter (its own peak RSS)."""
    cmd = [*module_argv("memory"), "--worker", "--config", config, "--dtypes", dtype]
    for k in ("layers", "embed_dim", "ffn_dim", "heads", "tokens_per_sample", "batch_size", "vocab", "threads"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(ns, k))]
    env = dict(os.environ, OMP_NUM_THREADS=str(ns.threads))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"{config}/{dtype} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: List[str] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--ffn-dim", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--tokens-per-sample", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--dtypes", default="fp32", help="comma-separated: fp32, bf16")
    p.add_argument("--configs", default="plain,checkpoint", help="comma-separated: plain, checkpoint")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default="plain", help=argparse.SUPPRESS)
    add_results_flag(p)
    ns = p.parse_args(argv)

    if ns.worker:
        import torch

        torch.set_num_threads(ns.threads)
        print(
            json.dumps(
                measure(
                    ns.layers,
                    ns.embed_dim,
                    ns.ffn_dim,
                    ns.heads,
                    ns.tokens_per_sample,
                    ns.batch_size,
                    ns.vocab,
                    checkpoint=ns.config == "checkpoint",
                    dtype=ns.dtypes,
                )
            )
        )
        return

    report = Report("activation_memory", argv=argv)
    results = {}
    for dtype in ns.dtypes.split(","):
        for config in ns.configs.split(","):
            results[f"{config}/{dtype}"] = run_config(ns, config, dtype)
    stats = {name: Stats([r["step_seconds"]]) for name, r in results.items()}
    shape = {
        k: getattr(ns, k)
        for k in ("layers", "embed_dim", "ffn_dim", "heads", "tokens_per_sample", "batch_size", "vocab", "threads")
    }
    for dtype in ns.dtypes.split(","):
        plain, ckpt = results.get(f"plain/{dtype}"), results.get(f"checkpoint/{dtype}")
        if plain and ckpt:
            results[f"checkpoint_vs_plain/{dtype}"] = {
                "saved_activation_ratio": ckpt["saved_activation_mb"] / plain["saved_activation_mb"],
                "peak_rss_growth_ratio": ckpt["peak_rss_growth_mb"] / max(plain["peak_rss_growth_mb"], 1e-9),
                "step_time_ratio": ckpt["step_seconds"] / plain["step_seconds"],
            }
    if not ns.json:
        first = next(iter(results.values()))
        print(
            f"transformer_lm {ns.layers} layers, C={ns.embed_dim}, FFN={ns.ffn_dim}, H={ns.heads}, "
            f"V={ns.vocab}, {first['params_m']:.1f}M params; batch {ns.batch_size} x {ns.tokens_per_sample} "
            f"tokens; one forward+backward, {ns.threads} thread(s)"
        )
        print(f"{'config':<18}{'saved activations MB':>22}{'peak RSS growth MB':>20}{'step s':>9}")
        for name, r in results.items():
            if "saved_activation_mb" in r:
                print(
                    f"{name:<18}{r['saved_activation_mb']:>22.1f}{r['peak_rss_growth_mb']:>20.1f}"
                    f"{r['step_seconds']:>9.2f}"
                )
        for name, r in results.items():
            if "saved_activation_ratio" in r:
                print(
                    f"{name}: saved activations x{r['saved_activation_ratio']:.3f}, "
                    f"peak RSS growth x{r['peak_rss_growth_ratio']:.3f}, step time x{r['step_time_ratio']:.2f}"
                )
    report.emit(stats, results=ns.results, shape=shape, rows=results)


if __name__ == "__main__":
    main()
