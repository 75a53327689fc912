"""lm-evaluation-harness requests/s: ``ToolkitLM`` against the harness's own ``hf`` model on the export.

    python -m benchmarks.eval_harness                          # transformer_lm 4 x 256, V 8192, CPU, 2 threads
    python -m benchmarks.eval_harness --arch llama_tiny --layers 4 --dim 256
    python -m benchmarks.eval_harness --device cuda --requests 2048 --batch-size 64

A randomly initialized checkpoint (a whitespace dictionary of ``--vocab`` words) is written as the
trainer writes one, exported with ``toolkit-export --format hf`` (XGLM for transformer_lm, Llama for
the Llama family), and both models answer the same requests:

- ``loglikelihood``: ``--contexts`` contexts of 64..``--context`` random words, each with 4
  continuations of 1..4 words (a multiple-choice task's shape); requests/s of
  ``ToolkitLM.loglikelihood`` and ``HFLM.loglikelihood`` at ``--batch-size``, alternated
  ``--repeats`` times (:func:`benchmarks.timing.alternate`; the best run of each), and the largest difference of their log-likelihoods;
- ``generate_until``: ``--gen-prompts`` prompts, greedy, ``--gen-tokens`` new tokens (no stop
  string), tokens/s with the KV cache (``SequenceGenerator``) and with ``HFLM.generate_until``.

Prints a table and one JSON line (``"benchmark": "eval_harness"``).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from typing import Dict, List

import torch

from benchmarks.timing import Report, Stats, add_results_flag, alternate
from toolkit.config import options
from toolkit.core import registry
from toolkit.data.dictionary import Dictionary
from toolkit.export.api import ExportConfig, run_export
from toolkit.models import build_model
from toolkit.models.init import init_weights


def write_checkpoint(folder: str, args) -> str:
    """A checkpoint (cfg + random weights) and its data-bin's dict.txt; returns the checkpoint path."""
    registry.import_all_components()
    d = Dictionary()
    for i in range(args.vocab - len(d)):
        d.add_symbol(f"w{i}")
    d.save(os.path.join(folder, "dict.txt"))
    given = {
        "decoder_layers": args.layers,
        "decoder_embed_dim": args.dim,
        "decoder_ffn_embed_dim": 4 * args.dim,
        "decoder_attention_heads": max(1, args.dim // 64),
    }
    if args.arch == "transformer_lm":
        given.update(
            decoder_input_dim=args.dim, decoder_output_dim=args.dim, dropout=0.0, decoder_normalize_before=True
        )  # XGLM is pre-norm
    cfg = {
        "task": "language_modeling",
        "arch": args.arch,
        "data": folder,
        "tokens_per_sample": args.positions,
        "sample_break_mode": "none",
        "add_bos_token": False,
        "seed": 1,
        **options.architecture_defaults(args.arch, {**given, "max_target_positions": args.positions}),
    }
    task_entry = registry.TASK_REGISTRY.get("language_modeling")
    task = task_entry.cls.setup_task(options.config_from_args(task_entry.config, cfg))
    model = build_model(args.arch, argparse.Namespace(**cfg), task)
    init_weights(model, seed=1)  # as toolkit-train initializes (the constructor may leave some tensors empty)
    path = os.path.join(folder, "checkpoint.pt")
    torch.save({"cfg": cfg, "model": model.state_dict()}, path)
    return path


def requests(args, vocab: int) -> Dict[str, list]:
    from lm_eval.api.instance import Instance

    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(vocab - 4)}" for _ in range(n))

    ll, gen = [], []
    for i in range(args.contexts):
        context = words(rng.randint(64, args.context))
        for _ in range(4):
            ll.append(Instance("loglikelihood", {}, (context, " " + words(rng.randint(1, 4))), len(ll)))
    for i in range(args.gen_prompts):
        gen.append(
            Instance(
                "generate_until",
                {},
                (words(rng.randint(32, 64)), {"until": [], "max_gen_toks": args.gen_tokens, "do_sample": False}),
                i,
            )
        )
    return {"loglikelihood": ll, "generate_until": gen}


def compare(models: Dict[str, object], reqs: Dict[str, list], repeats: int) -> Dict[str, Stats]:
    """Per request type and model ("loglikelihood toolkit", ...): ``repeats`` runs alternated between the models
    (the last run's outputs in ``last``)."""
    stats: Dict[str, Stats] = {}
    for kind, items in reqs.items():
        runs = {
            f"{kind} {name}": lambda lm=lm: getattr(lm, kind)(items, disable_tqdm=True) for name, lm in models.items()
        }
        stats.update(alternate(runs, repeats))
    return stats


def summarize(args, reqs, stats: Dict[str, Stats]) -> Dict:
    """The figures from the best run of each (the least disturbed on a shared machine)."""
    names = ("toolkit", "hf")
    diff = max(abs(a[0] - b[0]) for a, b in zip(stats["loglikelihood toolkit"].last, stats["loglikelihood hf"].last))
    n_ll = len(reqs["loglikelihood"])
    rate = {name: n_ll / stats[f"loglikelihood {name}"].min for name in names}
    gen_tokens = {name: sum(len(t.split()) for t in stats[f"generate_until {name}"].last) for name in names}
    gen_rate = {name: gen_tokens[name] / stats[f"generate_until {name}"].min for name in names}
    return {
        "arch": args.arch,
        "layers": args.layers,
        "dim": args.dim,
        "vocab": args.vocab,
        "device": args.device,
        "threads": args.threads,
        "batch_size": args.batch_size,
        "loglikelihood_requests": n_ll,
        "requests_per_s": rate,
        "speedup": rate["toolkit"] / rate["hf"],
        "max_abs_loglikelihood_diff": diff,
        "generate_tokens": gen_tokens,
        "generate_tokens_per_s": gen_rate,
        "generations_equal": stats["generate_until toolkit"].last == stats["generate_until hf"].last,
    }


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="transformer_lm", help="transformer_lm or a Llama-family arch (llama_tiny)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256, help="model width (heads of 64, FFN 4x)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--positions", type=int, default=512)
    p.add_argument("--contexts", type=int, default=64, help="loglikelihood contexts (4 requests each)")
    p.add_argument("--context", type=int, default=256, help="longest context in words")
    p.add_argument("--gen-prompts", type=int, default=8)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per model (alternated; the best counts)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="CPU threads")
    add_results_flag(p)
    return p.parse_args(argv)


def main(argv: List[str]) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    report = Report("eval_harness", device=args.device, argv=argv)
    from lm_eval.models.huggingface import HFLM

    from toolkit.evaluation.harness import ToolkitLM

    with tempfile.TemporaryDirectory() as folder:
        path = write_checkpoint(folder, args)
        run_export(ExportConfig(path=path, format="hf", out=os.path.join(folder, "hf")))
        models = {
            "toolkit": ToolkitLM(
                path=path, batch_size=args.batch_size, device=args.device, max_gen_toks=args.gen_tokens
            ),
            "hf": HFLM(
                pretrained=os.path.join(folder, "hf"),
                batch_size=args.batch_size,
                device=args.device,
                max_length=args.positions,
            ),
        }
        reqs = requests(args, args.vocab)
        stats = compare(models, reqs, args.repeats)
        summary = summarize(args, reqs, stats)
    print(f"{'':24}{'toolkit':>12}{'hf':>12}")
    print(
        f"{'loglikelihood req/s':24}{summary['requests_per_s']['toolkit']:12.1f}{summary['requests_per_s']['hf']:12.1f}"
        f"   speedup {summary['speedup']:.2f}x, max |diff| {summary['max_abs_loglikelihood_diff']:.2e}"
    )
    print(
        f"{'generate_until tok/s':24}{summary['generate_tokens_per_s']['toolkit']:12.1f}"
        f"{summary['generate_tokens_per_s']['hf']:12.1f}   same text: {summary['generations_equal']}"
    )
    report.emit(stats, results=args.results, **summary)


if __name__ == "__main__":
    main(sys.argv[1:])
