"""What ``--document-attention-mask`` costs: forward + backward of a model on packed blocks, plain causal vs
document-masked (and with ``--reset-position-ids``).

    python -m benchmarks.packing_mask                          # both families, B 4 x T 512, CPU, 2 threads
    python -m benchmarks.packing_mask --tokens 1024 --mean-doc 200 --device cuda

The blocks are random token streams cut into documents of geometric lengths (mean
``--mean-doc`` tokens), as ``--sample-break-mode none`` packs lines. The masked runs get the
``document_ids``/``positions`` the collater sends; on CPU the mask is a boolean SDPA mask (flex
attention's block mask on CUDA). Variants are alternated (:func:`benchmarks.timing.alternate`), ``--steps``
timed steps each after a warm-up, and the median reported with tokens/s and the cost relative to plain causal attention.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from benchmarks.timing import Report, add_results_flag, alternate
from toolkit.data.lm_dataset import document_layout
from toolkit.models import model_config
from toolkit.models.llama.model import LlamaLanguageModel
from toolkit.models.transformer_lm import TransformerLanguageModel, TransformerLMConfig

EOS, PAD, VOCAB = 2, 1, 1024  # a small vocabulary: the attention is what is measured


def build(family: str, dim: int, layers: int, positions: int, device: str) -> torch.nn.Module:
    if family == "transformer_lm":
        cfg = TransformerLMConfig(
            decoder_layers=layers,
            decoder_embed_dim=dim,
            decoder_ffn_embed_dim=4 * dim,
            decoder_attention_heads=dim // 64,
            max_target_positions=positions,
            dropout=0.0,
            decoder_normalize_before=True,
            decoder_learned_pos=True,
        )
        model = TransformerLanguageModel(cfg, VOCAB, PAD, seed=1)
    else:
        cfg = model_config(
            "llama",
            decoder_layers=layers,
            decoder_embed_dim=dim,
            decoder_ffn_embed_dim=3 * dim,
            decoder_attention_heads=dim // 64,
            decoder_kv_heads=max(1, dim // 256),
            max_target_positions=positions,
        )
        model = LlamaLanguageModel(cfg, VOCAB, PAD, seed=1)
    return model.to(device).train()


def packed_batch(batch: int, tokens: int, mean_doc: float, device: str):
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, VOCAB, (batch, tokens), generator=g)
    ends = torch.rand(batch, tokens, generator=g) < 1.0 / mean_doc
    src[ends] = EOS
    document_ids, positions = document_layout(src, EOS)
    return src.to(device), document_ids.to(device), positions.to(device)


def step(model, src, kwargs) -> None:
    logits = model(src, **kwargs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), src.roll(-1, 1).flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)


def time_variants(model, src, variants, steps: int, device: str):
    contestants = {name: lambda kwargs=kwargs: step(model, src, kwargs) for name, kwargs in variants.items()}
    return alternate(contestants, steps, warmup=1, device=device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--families", nargs="+", default=["transformer_lm", "llama"])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--mean-doc", type=float, default=100.0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    add_results_flag(p)
    args = p.parse_args()
    report = Report("packing_mask", device=args.device)
    torch.set_num_threads(args.threads)
    src, document_ids, positions = packed_batch(args.batch, args.tokens, args.mean_doc, args.device)
    variants = {
        "causal": {},
        "document mask": {"document_ids": document_ids},
        "mask + reset positions": {"document_ids": document_ids, "positions": positions},
    }
    results, all_stats = {}, {}
    print(
        f"B {args.batch} x T {args.tokens}, documents of ~{args.mean_doc:.0f} tokens "
        f"({int(document_ids[:, -1].float().mean()) + 1} per row), d {args.dim} x {args.layers} layers, "
        f"{args.device}, {args.threads} threads, load {os.getloadavg()[0]:.2f}"
    )
    print(f"{'family':<16}{'variant':<26}{'ms/step':>10}{'tokens/s':>12}{'cost':>9}")
    for family in args.families:
        model = build(family, args.dim, args.layers, args.tokens, args.device)
        stats = time_variants(model, src, variants, args.steps, args.device)
        all_stats.update({f"{family}/{name}": st for name, st in stats.items()})
        base = stats["causal"].median
        for name, seconds in ((name, st.median) for name, st in stats.items()):
            tps = args.batch * args.tokens / seconds
            cost = seconds / base - 1
            print(f"{family:<16}{name:<26}{seconds * 1e3:>10.1f}{tps:>12.0f}{cost:>+9.1%}")
            results[f"{family}/{name}"] = {
                "ms": round(seconds * 1e3, 2),
                "tokens_per_s": round(tps),
                "cost": round(cost, 4),
            }
    report.emit(
        all_stats,
        results=args.results,
        device=args.device,
        threads=args.threads,
        batch=args.batch,
        tokens=args.tokens,
        mean_doc=args.mean_doc,
        rows=results,
    )


if __name__ == "__main__":
    main()
