"""Training step of the toolkit's MoE (Qwen3-MoE shape) against transformers' ``Qwen3MoeForCausalLM``, on CPU.

    python -m benchmarks.moe_vs_hf                        # 4 x 256, 8 experts of 256, top 2, V 8192, B 8 x T 256
    python -m benchmarks.moe_vs_hf --hf-experts eager     # transformers' loop over experts in Python

Same config, same initial weights (ours copied into transformers' in-memory layout: its experts are fused
``gate_up_proj`` [E, 2F, C] / ``down_proj`` [E, C, F] tensors in transformers 5), same batches (uniformly random
tokens) and AdamW; one step is forward, fp32 cross entropy over all targets, backward, AdamW step, zero_grad
(``llama_hf.py``'s step; no auxiliary loss on either side). The two alternate step by step in one process;
``--warmup`` rounds are discarded. ``--hf-experts``: transformers' ``experts_implementation`` (default: what it
picks itself, recorded in the JSON line). Reports the median step times, tokens/s, their ratio (above 1: ours
is faster), the last losses' difference and one JSON line (``"benchmark": "moe_vs_transformers"``).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.llama_hf import alternated, logits_loss, make_step, on_library
from benchmarks.timing import Report, add_results_flag
from toolkit import ops


def parse(argv=None):
    from toolkit.config import CPU_MATMUL_CHOICES  # the commands' --cpu-matmul (no torch import)

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-ffn", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=256, help="T, tokens per row")
    ap.add_argument("--batch", type=int, default=8, help="B, rows per step")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds (one step of each model per round)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--cpu-matmul",
        default="auto",
        choices=CPU_MATMUL_CHOICES,
        help="the toolkit's fp32 matmul library, as its commands' flag (transformers runs torch's)",
    )
    ap.add_argument(
        "--hf-experts",
        default=None,
        help="transformers' experts_implementation (eager, grouped_mm, batched_mm; default: its own choice)",
    )
    add_results_flag(ap)
    return ap.parse_args(argv)


def in_memory_hf_state(state):
    """Our state dict in transformers 5's in-memory names (fused expert tensors), from the file layout."""
    from toolkit.models.common.hf_adapter import DECODER_KEYS

    out = {}
    for name, tensor in ((DECODER_KEYS.to_hf(k), v) for k, v in state.items()):
        if name.endswith("mlp.experts.up_proj"):
            continue
        if name.endswith("mlp.experts.gate_proj"):
            up = state[name[len("model.") :].replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([tensor, up], dim=1)
        else:
            out[name] = tensor
    return out


def build_pair(args):
    """Our model and transformers' with the same config and weights (fp32, CPU)."""
    import transformers

    from toolkit.models import model_config
    from toolkit.models.moe.hf import MoEAdapter
    from toolkit.models.moe.model import MoELanguageModel

    cfg = model_config(
        "moe_tiny",
        decoder_layers=args.layers,
        decoder_embed_dim=args.dim,
        decoder_attention_heads=args.heads,
        decoder_kv_heads=args.kv_heads,
        decoder_head_dim=args.dim // args.heads,
        moe_num_experts=args.experts,
        moe_top_k=args.top_k,
        moe_ffn_embed_dim=args.expert_ffn,
        max_target_positions=args.tokens,
    )
    ours = MoELanguageModel(cfg, args.vocab, padding_idx=1, seed=1)
    _, config = MoEAdapter().hf_config(cfg, args.vocab)
    extra = {} if args.hf_experts is None else {"experts_implementation": args.hf_experts}
    theirs = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config, **extra))
    theirs.load_state_dict(in_memory_hf_state(ours.state_dict()), strict=True)
    return ours.train(), theirs.train()


def toolkit_logits(model, tokens):
    """Our logits (with the toolkit's fp32 matmul library, --cpu-matmul: ``on_library``)."""
    return model(tokens)[0]


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    onednn = ops.select(args.cpu_matmul)
    ours, theirs = build_pair(args)
    steps = {
        "toolkit": on_library(make_step(ours, logits_loss(toolkit_logits)), onednn),
        "transformers": on_library(
            make_step(theirs, logits_loss(lambda m, x: m(input_ids=x, use_cache=False).logits)), False
        ),
    }
    stats, figures = alternated(steps, args)
    return stats, {
        **{k: v for k, v in vars(args).items() if k not in ("hf_experts", "results")},
        "hf_experts": getattr(theirs.config, "_experts_implementation", None),
        "cpu_matmul": "onednn" if onednn else "torch",
        **figures,
    }


def main(argv=None) -> None:
    report = Report("moe_vs_transformers", argv=argv)
    args = parse(argv)
    stats, result = run(args)
    for name in ("toolkit", "transformers"):
        print(f"{name:>12}: {result['step_ms'][name]:8.1f} ms/step  {result['tokens_per_s'][name]:9.1f} tokens/s")
    print(
        f"toolkit / transformers ({result['hf_experts']} experts): {result['speedup']:.2f}x (median of "
        f"{result['rounds']} alternated steps); last losses differ by {result['last_loss_diff']:.2e}"
    )
    report.emit(stats, baseline="toolkit", results=args.results, **result)


if __name__ == "__main__":
    main()
