"""toolkit-export timings: each format's export, and decoding through onnxruntime's cache graph.

    python benchmarks/export.py                      # transformer_lm, 4 x 256, V 8192, 256 positions
    python benchmarks/export.py --layers 6 --dim 512 --new-tokens 64

Prints a table, then one JSON line. Decoding compares greedy continuation of a 32-token prompt:
PyTorch recomputing the whole prefix per token (the model has no cache path) against the ONNX
cache graph in onnxruntime (prompt pass, then one token per step); both on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from toolkit.config import options  # noqa: E402
from toolkit.data.dictionary import Dictionary  # noqa: E402
from toolkit.export import onnx_format  # noqa: E402
from toolkit.export.api import ExportConfig, run_export  # noqa: E402
from toolkit.inference import load_model  # noqa: E402
from toolkit.models import model_config  # noqa: E402
from toolkit.models.transformer_lm import TransformerLanguageModel  # noqa: E402


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


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_speeds(path: str, onnx_dir: str, args) -> dict:
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

    out = {}
    onnx_format.greedy_decode(sess, args.layers, shape, prompt, 2)  # warm-up
    out["ort_cache_s"] = timed(lambda: onnx_format.greedy_decode(sess, args.layers, shape, prompt, args.new_tokens))
    out["torch_recompute_s"] = timed(torch_greedy)
    same = torch.equal(onnx_format.greedy_decode(sess, args.layers, shape, prompt, args.new_tokens), torch_greedy())
    out["same_tokens"] = bool(same)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--positions", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = {"load_average": os.getloadavg()[0], **vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(tmp, args)
        for fmt, extra in (("safetensors", {}), ("hf", {}), ("onnx", {"kv_cache": True})):
            out = os.path.join(tmp, fmt)
            results[f"export_{fmt}_s"] = timed(
                lambda: run_export(ExportConfig(path=path, format=fmt, out=out, **extra))
            )
        results.update(decode_speeds(path, os.path.join(tmp, "onnx"), args))
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
    print(json.dumps(results))


if __name__ == "__main__":
    main()
