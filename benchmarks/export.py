"""toolkit-export timings: each format's export, and decoding through onnxruntime's cache graph.

    python -m benchmarks.export                      # transformer_lm, 4 x 256, V 8192, 256 positions
    python -m benchmarks.export --layers 6 --dim 512 --new-tokens 64

Prints a table, then one JSON line. Decoding compares greedy continuation of a 32-token prompt:
PyTorch recomputing the whole prefix per token (the model has no cache path) against the ONNX
cache graph in onnxruntime (prompt pass, then one token per step); both on the CPU, alternated
``--rounds`` times (:func:`benchmarks.timing.alternate`) after a short onnxruntime warm-up.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from benchmarks.timing import Report, Stats, add_results_flag, alternate, time_call
from toolkit.config import options
from toolkit.data.dictionary import Dictionary
from toolkit.export import onnx_format
from toolkit.export.api import ExportConfig, run_export
from toolkit.inference import load_model
from toolkit.models import model_config
from toolkit.models.transformer_lm import TransformerLanguageModel


def write_checkpoint(folder: str, args) -> str:
    d = Dictionary()
    for i in range(args.vocab - 4):
        d.add_symbol(f"w{i}")
    d.save(os.path.join(folder, "dict.txt"))
    given = dict(
        decoder_layers=args.layers,
        decoder_embed_dim=args.dim,
        decoder_ffn_embed_dim=4 * args.dim,
        decoder_attention_heads=args.heads,
        decoder_input_dim=args.dim,  # no projections in and out, and pre-norm: the layout transformers'
        decoder_output_dim=args.dim,  # classes compute (--format hf)
        decoder_normalize_before=True,
        dropout=0.0,
    )
    cfg = {
        "task": "language_modeling",
        "arch": "transformer_lm",
        "data": folder,
        "tokens_per_sample": args.positions,
        **options.architecture_defaults("transformer_lm", given),
    }
    model = TransformerLanguageModel(
        model_config("transformer_lm", max_target_positions=args.positions, **given), len(d), d.pad(), seed=0
    )
    path = os.path.join(folder, "checkpoint.pt")
    torch.save({"cfg": cfg, "model": model.state_dict()}, path)
    return path


def decode_speeds(path: str, onnx_dir: str, args):
    model, _, _ = load_model(path)
    prompt = torch.randint(4, args.vocab, (1, 32), generator=torch.Generator().manual_seed(0))
    sess = onnx_format.session(os.path.join(onnx_dir, onnx_format.DECODER_WITH_PAST), threads=args.threads)
    shape = (args.heads, args.dim // args.heads)

    def torch_greedy():
        tokens = prompt
        with torch.no_grad():
            for _ in range(args.new_tokens):
                tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return tokens

    onnx_format.greedy_decode(sess, args.layers, shape, prompt, 2)  # warm-up
    stats = alternate(
        {
            "ort_cache": lambda: onnx_format.greedy_decode(sess, args.layers, shape, prompt, args.new_tokens),
            "torch_recompute": torch_greedy,
        },
        args.rounds,
    )
    same = torch.equal(stats["ort_cache"].last, stats["torch_recompute"].last)
    out = {f"{name}_s": st.median for name, st in stats.items()}
    out["same_tokens"] = bool(same)
    return stats, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--positions", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="timed decoding rounds of each (alternated)")
    add_results_flag(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    report = Report("export")
    results = {"load_average": os.getloadavg()[0], **{k: v for k, v in vars(args).items() if k != "results"}}
    stats = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(tmp, args)
        for fmt, extra in (("safetensors", {}), ("hf", {}), ("onnx", {"kv_cache": True})):
            out = os.path.join(tmp, fmt)
            seconds, _ = time_call(lambda: run_export(ExportConfig(path=path, format=fmt, out=out, **extra)))
            stats[f"export {fmt}"], results[f"export_{fmt}_s"] = Stats([seconds]), seconds
        decode, figures = decode_speeds(path, os.path.join(tmp, "onnx"), args)
        stats.update(decode)
        results.update(figures)
    n = args.new_tokens
    print(
        f"model: {args.layers} x {args.dim}, V {args.vocab}, {args.positions} positions; "
        f"load average {results['load_average']:.1f}"
    )
    for fmt in ("safetensors", "hf", "onnx"):
        print(f"  export {fmt:<12} {results[f'export_{fmt}_s']:7.2f} s")
    print(
        f"  greedy {n} tokens: PyTorch recompute {n / results['torch_recompute_s']:7.1f} tok/s, "
        f"onnxruntime cache graph {n / results['ort_cache_s']:7.1f} tok/s, same tokens: {results['same_tokens']}"
    )
    report.emit(stats, results=args.results, **results)


if __name__ == "__main__":
    main()
