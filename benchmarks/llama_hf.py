"""Training throughput of the toolkit's Llama against transformers' ``LlamaForCausalLM``, on CPU.

    python benchmarks/llama_hf.py                       # 4 x 256, FFN 688, 8 heads on 4 KV heads, V 8192
    python benchmarks/llama_hf.py --layers 2 --rounds 6 --threads 1

Both models have the same config and the same initial weights (ours copied into transformers'
through the Hugging Face adapter, ``toolkit.models.llama.hf``), see the same batches (uniformly
random tokens, B x T, every row full) and take the same AdamW steps. One training step is:
forward to logits, fp32 cross entropy over all B x T targets, backward, AdamW step, zero_grad.
The two are alternated step by step in one process (ours, theirs, ours, ...), so a neighbour
process on a shared machine slows both alike; ``--warmup`` rounds are discarded.

Reports the median step time and tokens/s of each, their ratio (ours / theirs, above 1 is
faster), the largest difference of the losses of the last round (a check that both computed the
same thing), and one JSON line (``"benchmark": "llama_vs_transformers"``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    return ap.parse_args(argv)


def build_pair(args):
    """Our model and transformers' with the same config and weights (fp32, CPU)."""
    import transformers

    from toolkit.models import model_config
    from toolkit.models.llama.hf import hf_config, state_to_hf
    from toolkit.models.llama.model import LlamaLanguageModel

    cfg = model_config("llama", decoder_layers=args.layers, decoder_embed_dim=args.dim,
                       decoder_ffn_embed_dim=args.ffn, decoder_attention_heads=args.heads,
                       decoder_kv_heads=args.kv_heads, max_target_positions=args.tokens)
    ours = LlamaLanguageModel(cfg, args.vocab, padding_idx=1, seed=1)
    _, config = hf_config(cfg, args.vocab)
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    theirs.load_state_dict(state_to_hf(ours.state_dict()), strict=True)
    return ours.train(), theirs.train()


def make_step(model, logits_of):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def step(tokens: torch.Tensor) -> float:
        logits = logits_of(model, tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    ours, theirs = build_pair(args)
    steps = {"toolkit": make_step(ours, lambda m, x: m(x)),
             "transformers": make_step(theirs, lambda m, x: m(input_ids=x, use_cache=False).logits)}
    return {"benchmark": "llama_vs_transformers", "layers": args.layers, "dim": args.dim, "ffn": args.ffn,
            "heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab, "tokens": args.tokens,
            "batch": args.batch, "threads": args.threads, "rounds": args.rounds, "torch": torch.__version__,
            **alternated(steps, args)}


def alternated(steps, args) -> dict:
    """Time ``steps`` (name -> step(tokens)) alternated on the same random batches, ``args.warmup`` rounds
    untimed; the median step of each, tokens/s, toolkit / transformers and how far their last losses differ."""
    g = torch.Generator().manual_seed(0)
    times = {name: [] for name in steps}
    losses = {}
    for r in range(args.warmup + args.rounds):
        tokens = torch.randint(0, args.vocab, (args.batch, args.tokens + 1), generator=g)
        for name, step in steps.items():
            t0 = time.perf_counter()
            losses[name] = step(tokens)
            if r >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    tokens_per_step = args.batch * args.tokens
    median = {name: statistics.median(t) for name, t in times.items()}
    return {"step_ms": {k: round(v * 1e3, 1) for k, v in median.items()},
            "tokens_per_s": {k: round(tokens_per_step / v, 1) for k, v in median.items()},
            "speedup": round(median["transformers"] / median["toolkit"], 3),
            "last_loss_diff": abs(losses["toolkit"] - losses["transformers"])}


def main(argv=None) -> None:
    result = run(parse(argv))
    for name in ("toolkit", "transformers"):
        print(f"{name:>12}: {result['step_ms'][name]:8.1f} ms/step  {result['tokens_per_s'][name]:9.1f} tokens/s")
    print(f"toolkit / transformers: {result['speedup']:.2f}x (median of {result['rounds']} alternated steps); "
          f"last losses differ by {result['last_loss_diff']:.2e}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
