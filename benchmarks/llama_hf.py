"""Training throughput of the toolkit's Llama against transformers' ``LlamaForCausalLM``, on CPU.

    python -m benchmarks.llama_hf                       # 4 x 256, FFN 688, 8 heads on 4 KV heads, V 8192
    python -m benchmarks.llama_hf --layers 2 --rounds 6 --threads 1
    python -m benchmarks.llama_hf --contestants toolkit          # one alone: its peak memory (peak_rss_mib)

Both models have the same config and the same initial weights (ours copied into transformers'
through the Hugging Face adapter, ``toolkit.models.llama.hf``), see the same batches (uniformly
random tokens, B x T, every row full) and take the same AdamW steps (torch's fused kernel: both tools'
default). One training step is each side's own training path, then backward, AdamW step, zero_grad:

- ``toolkit``: ``toolkit-train``'s, the ``cross_entropy`` criterion on a fairseq sample (the summed NLL, divided
  by the sample size as the trainer does), with its default fused output layer + loss
  (``--head-loss-chunk-rows``, ``toolkit.models.fused_loss``) and its fp32 matmul library (``--cpu-matmul``:
  auto picks oneDNN where this CPU runs it faster than torch's MKL, ``toolkit.core.cpu_gemm``);
- ``toolkit-logits``: the same with ``--head-loss-chunk-rows 0``: [B*T, V] logits, then the fp32 cross-entropy
  (the toolkit before the fused head);
- ``toolkit-compile`` (not by default): ``toolkit``, each block compiled as ``toolkit-train --compile`` does
  (inductor; warm-up rounds include the compilation);
- ``transformers``: ``LlamaForCausalLM(input_ids, labels=...)``, its own loss (logits, ``.float()``, mean
  cross-entropy); the targets that are our padding index are -100 for it, so both count the same tokens.

The contestants are alternated step by step in one process (ours, theirs, ours, ...:
:func:`benchmarks.timing.alternate`), so a neighbour process on a shared machine slows all alike; ``--warmup``
rounds are discarded.

Reports the median step time and tokens/s of each, toolkit / transformers (above 1 is faster), toolkit /
toolkit-logits (what fusing gains), the largest difference of the per-token losses of the last round (a check
that all computed the same thing), the process's peak resident memory (meaningful with one contestant), and one
JSON line (``"benchmark": "llama_vs_transformers"``).
"""

from __future__ import annotations

import argparse
import copy
import resource

import torch

from benchmarks.timing import Report, add_results_flag, alternate


def parse(argv=None):
    from toolkit.config import CPU_MATMUL_CHOICES  # the commands' --cpu-matmul (no torch import)

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(ap)
    ap.add_argument(
        "--contestants",
        default="toolkit,toolkit-logits,transformers",
        help="comma-separated, from toolkit, toolkit-logits, toolkit-compile (blocks compiled as "
        "toolkit-train --compile does), transformers",
    )
    ap.add_argument(
        "--cpu-matmul",
        default="auto",
        choices=CPU_MATMUL_CHOICES,
        help="the toolkit contestants' fp32 matmul library, as toolkit-train's flag (transformers always runs torch's)",
    )
    ap.add_argument(
        "--head-loss-chunk-rows",
        type=int,
        default=None,
        help="the toolkit contestant's --head-loss-chunk-rows (default: the criterion's default)",
    )
    add_results_flag(ap)
    return ap.parse_args(argv)


def add_step_args(ap: argparse.ArgumentParser) -> None:
    """The model's shape, the batch, the rounds and the threads (shared with cpu_matmul_switch.py)."""
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=688)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=256, help="T, tokens per row")
    ap.add_argument("--batch", type=int, default=8, help="B, rows per step")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds (one step of each model per round)")
    ap.add_argument("--threads", type=int, default=2)


def build_ours(args):
    """The toolkit's Llama of ``args``' shape (fp32, CPU, seed 1) and its config."""
    from toolkit.models import model_config
    from toolkit.models.llama.model import LlamaLanguageModel

    cfg = model_config(
        "llama",
        decoder_layers=args.layers,
        decoder_embed_dim=args.dim,
        decoder_ffn_embed_dim=args.ffn,
        decoder_attention_heads=args.heads,
        decoder_kv_heads=args.kv_heads,
        max_target_positions=args.tokens,
    )
    return LlamaLanguageModel(cfg, args.vocab, padding_idx=1, seed=1), cfg


def build_pair(args):
    """Our model and transformers' with the same config and weights (fp32, CPU)."""
    import transformers

    from toolkit.models.llama.hf import LlamaAdapter

    ours, cfg = build_ours(args)
    adapter = LlamaAdapter()
    _, config = adapter.hf_config(cfg, args.vocab)
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    theirs.load_state_dict(adapter.state_to_hf(ours.state_dict(), config["model_type"]), strict=True)
    return ours.train(), theirs.train()


PAD = 1  # the toolkit model's padding index: targets equal to it count nothing on either side


def make_step(model, loss_of):
    """One training step with each tool's default optimizer: torch's fused AdamW kernel (the toolkit's adam uses
    it wherever it is supported; transformers' Trainer defaults to ``adamw_torch_fused`` on torch >= 2.8)."""
    from toolkit.optim.adam import fused_supported

    params = list(model.parameters())
    kernel = {"fused": True} if fused_supported(params) else {}
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, **kernel)

    def step(tokens: torch.Tensor) -> float:
        loss = loss_of(model, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def logits_loss(logits_of):
    """A loss from a model's logits (``logits_of(model, inputs)``): fp32 cross entropy, padding ignored, mean per
    token; the same math on both sides where a pair is compared on its logits (moe_vs_hf.py, no auxiliary loss)."""

    def loss_of(model, inputs, targets):
        logits = logits_of(model, inputs)
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=PAD
        )

    return loss_of


def toolkit_loss(chunk_rows):
    """The toolkit's training loss: the ``cross_entropy`` criterion on a sample, per token as the trainer
    normalizes it (``chunk_rows`` 0: logits, then the loss)."""
    from types import SimpleNamespace

    from toolkit.config.components import CrossEntropyCriterionConfig
    from toolkit.criterions.cross_entropy import CrossEntropyCriterion
    from toolkit.train.trainer import forward_and_loss

    cfg = (
        CrossEntropyCriterionConfig()
        if chunk_rows is None
        else CrossEntropyCriterionConfig(head_loss_chunk_rows=chunk_rows)
    )
    criterion = CrossEntropyCriterion(SimpleNamespace(target_dictionary=SimpleNamespace(pad=lambda: PAD)), cfg)

    def loss_of(model, inputs, targets):
        sample = {
            "net_input": {"src_tokens": inputs},
            "target": targets,
            "ntokens": int(targets.ne(PAD).sum()),
            "nsentences": targets.size(0),
        }
        loss, sample_size, _ = forward_and_loss(model, criterion, sample)
        return loss / sample_size

    return loss_of


def compiled(model):
    """The model as ``toolkit-train --compile`` runs it: each block compiled (inductor), the head and loss eager."""
    from toolkit.distributed.compile import apply_compile

    apply_compile(model, torch.device("cpu"))
    return model


def transformers_loss(model, inputs, targets):
    """transformers' own training path: ``labels=`` (already shifted here), its mean cross-entropy."""
    labels = targets.masked_fill(targets.eq(PAD), -100)
    return model(input_ids=inputs, labels=labels, shift_labels=labels, use_cache=False).loss


def on_library(step, onednn: bool):
    """``step`` with the process's fp32 CPU matmul library set first (``toolkit.ops``): the toolkit's sides run
    ``--cpu-matmul``'s choice, as its commands set it for their process; a peer in this process runs torch's, as
    its own code would."""
    from toolkit import ops

    def run(tokens):
        ops.restore(onednn)
        return step(tokens)

    return run


def run(args) -> dict:
    from toolkit import ops

    torch.set_num_threads(args.threads)
    onednn = ops.select(args.cpu_matmul)
    ours, theirs = build_pair(args)
    chosen = args.contestants.split(",")
    all_steps = {
        "toolkit": lambda: make_step(ours, toolkit_loss(args.head_loss_chunk_rows)),
        "toolkit-logits": lambda: make_step(copy.deepcopy(ours), toolkit_loss(0)),
        "toolkit-compile": lambda: make_step(compiled(copy.deepcopy(ours)), toolkit_loss(args.head_loss_chunk_rows)),
        "transformers": lambda: make_step(theirs, transformers_loss),
    }
    unknown = set(chosen) - set(all_steps)
    if unknown:
        raise SystemExit(f"--contestants: unknown {sorted(unknown)}; choose from {sorted(all_steps)}")
    if "transformers" not in chosen:
        del theirs
    steps = {name: on_library(all_steps[name](), onednn and name != "transformers") for name in chosen}
    stats, figures = alternated(steps, args)
    return stats, {
        "layers": args.layers,
        "dim": args.dim,
        "ffn": args.ffn,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "vocab": args.vocab,
        "tokens": args.tokens,
        "batch": args.batch,
        "threads": args.threads,
        "rounds": args.rounds,
        "head_loss_chunk_rows": args.head_loss_chunk_rows,
        "cpu_matmul": "onednn" if onednn else "torch",
        **figures,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def alternated(steps, args):
    """Time ``steps`` (name -> step(tokens)) alternated (:func:`benchmarks.timing.alternate`) on the same random
    batches, ``args.warmup`` rounds untimed: (each one's stats, the figures: median step ms, tokens/s, toolkit over
    transformers and over the logits path, how far their last losses differ)."""
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.tokens + 1), generator=g)
        for _ in range(args.warmup + args.rounds)
    ]

    def contestant(step):
        feed = iter(batches)  # every contestant sees the same batch in the same round
        return lambda: step(next(feed))

    stats = alternate({name: contestant(step) for name, step in steps.items()}, args.rounds, args.warmup)
    losses = {name: s.last for name, s in stats.items()}
    tokens_per_step = args.batch * args.tokens
    out = {
        "step_ms": {k: round(s.median * 1e3, 1) for k, s in stats.items()},
        "tokens_per_s": {k: round(s.rate(tokens_per_step), 1) for k, s in stats.items()},
        "last_loss_diff": max(losses.values()) - min(losses.values()),
    }
    for name, ours, other in (
        ("speedup", "toolkit", "transformers"),
        ("fused_speedup", "toolkit", "toolkit-logits"),
        ("compiled_speedup", "toolkit-compile", "transformers"),
    ):
        if ours in stats and other in stats:  # the other's median over ours, above 1: ours is faster
            out[name] = round(stats[other].median / stats[ours].median, 3)
    return stats, out


def main(argv=None) -> None:
    report = Report("llama_vs_transformers", argv=argv)
    args = parse(argv)
    stats, result = run(args)
    for name in result["step_ms"]:
        print(f"{name:>14}: {result['step_ms'][name]:8.1f} ms/step  {result['tokens_per_s'][name]:9.1f} tokens/s")
    for key, over in (("speedup", "transformers"), ("fused_speedup", "toolkit-logits")):
        if key in result:
            print(f"toolkit / {over}: {result[key]:.2f}x (median of {result['rounds']} alternated steps)")
    if "compiled_speedup" in result:
        print(f"toolkit --compile / transformers: {result['compiled_speedup']:.2f}x")
    print(
        f"last per-token losses differ by {result['last_loss_diff']:.2e}; "
        f"peak resident memory {result['peak_rss_mib']} MiB (of the whole process)"
    )
    report.emit(stats, baseline="toolkit" if "toolkit" in stats else None, results=args.results, **result)


if __name__ == "__main__":
    main()
