"""Generation tokens/s with the KV cache and without it (the whole prefix recomputed every step).

    python -m benchmarks.generate                          # transformer_lm_gpt2_small, CPU, batch 1, 256 + 256
    python -m benchmarks.generate --preset tiny --full     # small model: the estimate checked against a full run
    python -m benchmarks.generate --preset gpt3_xl --device cuda --dtype bf16   # batch 1 and 16 on a GPU
    python -m benchmarks.generate --preset tiny --profile-step [--arch llama_tiny]   # host cost of one step
    python -m benchmarks.generate --preset gpt3_xl --device cuda --dtype bf16 --profile-step --eos-check-interval 8
    python -m benchmarks.generate --preset llama3_1b --device cuda --dtype bf16 --versus-transformers

What runs is ``toolkit.generation.SequenceGenerator`` (the code path of toolkit-generate,
toolkit-interactive and the hub): greedy decoding (``--beam 1``) of ``--new`` tokens after a
``--prompt``-token prompt of random tokens, on a randomly initialized model (``init_weights``)
with a ``--vocab``-word vocabulary. ``</s>`` is banned until the last step, so every row
generates exactly ``--new`` tokens. Tokens/s = batch x new tokens / wall time, prompt
reading (prefill) included.

With the cache, the generator runs end to end. Without it, every step runs the model on the
whole prefix; on a CPU that takes tens of minutes for gpt2_small, so by default the no-cache
time is *estimated*: the prefill plus ``--sample-steps`` no-cache steps timed (best of two) at evenly
spaced prefix lengths, integrated over all steps (trapezoid rule; a step's cost grows
smoothly with its prefix). ``--full`` runs the no-cache generator end to end instead (and
prints the estimate beside it, to check the estimate). GPU presets run it in full.

``--profile-step`` measures instead what one cached decoding step costs the host: ms per new
token, operators per step (the model's and the search's apart) and host-device synchronizations
per step (``.item()``/``bool()``/``.tolist()``/``.cpu()``/``nonzero``/boolean indexing/``torch.equal``:
each one waits for the GPU's queue to drain, so the next step's kernels cannot be queued ahead).
Per step = (cost of generating ``--new`` tokens - cost of ``--new // 4``) / the difference, so the
prefill and the last step's bookkeeping cancel out. On a CPU with a tiny model the time is almost
all host work, the part a GPU does not speed up.

``--versus-transformers`` times cached greedy decoding at batch 1 against transformers' ``generate()`` on the
same model (ours exported through its family's Hugging Face adapter, ``model.hf_weights``), the same prompt
and the same number of new tokens (``min_new_tokens``), alternated round by round
(:func:`benchmarks.timing.alternate`, ``--rounds`` after ``--warmup``), and whether both chose the same tokens.

Prints a table and one JSON line (``"benchmark": "generate"``, ``"generate_step"`` or
``"decode_vs_transformers"``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List

import torch

from benchmarks.timing import Report, Stats, add_results_flag, alternate, median, repeat, time_call
from toolkit.config import options
from toolkit.core import registry
from toolkit.data.dictionary import Dictionary
from toolkit.generation import GenerationConfig, SequenceGenerator
from toolkit.generation.step_counter import StepCounter

PRESETS = {
    # name: (arch, vocabulary, batch sizes, device, run the no-cache path in full)
    "gpt2_small": ("transformer_lm_gpt2_small", 50264, [1], "cpu", False),
    "tiny": ("transformer_lm_gpt2_tiny", 8192, [1], "cpu", True),
    "gpt3_xl": ("transformer_lm_gpt3_xl", 50264, [1, 16], "cuda", True),
    "llama3_1b": ("llama3_1b", 128256, [1], "cuda", True),
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def build(arch: str, vocab: int, max_positions: int, device: torch.device, dtype: torch.dtype):
    """A randomly initialized model of ``arch`` and a dictionary of ``vocab`` symbols."""
    registry.import_all_components()
    entry = registry.resolve_arch(arch)  # any decoder family: transformer_lm_*, llama_*
    values = options.architecture_defaults(arch, {"max_target_positions": max_positions})
    cfg = options.config_from_args(entry.config, values)
    d = Dictionary()
    for i in range(vocab - len(d)):
        d.add_symbol(f"w{i}")
    with torch.device(device):
        model = entry.cls(cfg, len(d), d.pad(), seed=0)
    return model.to(dtype).eval(), d


def generator(
    model, d, prompt: int, new: int, incremental: bool, eos_check_interval: int = 1, ban_eos: bool = True
) -> SequenceGenerator:
    """Greedy; ``ban_eos``: </s> only at the last step (every row generates ``new`` tokens)."""
    cfg = GenerationConfig(beam=1, max_len_b=prompt + new, min_len=prompt + new if ban_eos else 1)
    return SequenceGenerator([model], d, cfg, incremental=incremental, eos_check_interval=eos_check_interval)


def run_generator(gen: SequenceGenerator, prompts: torch.Tensor, device: torch.device) -> float:
    elapsed, hypos = time_call(lambda: gen.generate(list(prompts)), device)
    assert all(len(h[0]["tokens"]) == gen.cfg.max_len_b + 1 for h in hypos)
    return elapsed


@torch.no_grad()
def estimate_no_cache(model, prompts: torch.Tensor, new: int, samples: int, device: torch.device) -> float:
    """Prefill + every no-cache step, integrated from ``samples`` timed steps (trapezoid rule)."""
    B, P = prompts.shape
    tokens = torch.randint(4, model.embed_tokens.num_embeddings, (B, P + new + 1), device=device)

    def step_seconds(length: int) -> float:
        """The faster of two runs: the first of a new shape also pays one-off allocation costs."""

        def step():
            out = model(tokens[:, :length])
            return model.get_normalized_probs(out[:, -1:], log_probs=True).argmax(-1)

        return repeat(step, 2, device=device).min

    prefill = step_seconds(P + 1)
    lengths = sorted({P + 2 + round(i * (new - 1) / max(samples - 1, 1)) for i in range(samples)})
    timed = [(n, step_seconds(n)) for n in lengths]
    total = sum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in zip(timed, timed[1:]))
    total += (timed[0][1] + timed[-1][1]) / 2  # the trapezoid sum counts the end points half
    return prefill + total


def measure(model, d, batch: int, args, full_no_cache: bool, device: torch.device) -> Dict:
    prompts = torch.randint(4, len(d), (batch, args.prompt), generator=torch.Generator().manual_seed(0))
    cached = run_generator(generator(model, d, args.prompt, args.new, True, args.eos_check_interval), prompts, device)
    estimated = estimate_no_cache(model, prompts.to(device), args.new, args.sample_steps, device)
    full = run_generator(generator(model, d, args.prompt, args.new, False), prompts, device) if full_no_cache else None
    no_cache = full if full is not None else estimated
    tokens = batch * args.new
    return {
        "batch": batch,
        "cache_s": cached,
        "cache_tokens_per_s": tokens / cached,
        "no_cache_s": no_cache,
        "no_cache_tokens_per_s": tokens / no_cache,
        "no_cache_estimated_s": estimated,
        "no_cache_measured": full is not None,
        "speedup": no_cache / cached,
    }


def counts(model, gen: SequenceGenerator, prompts: List[torch.Tensor]):
    with StepCounter(model) as counter:
        gen.generate(prompts)
    return counter.model_ops, counter.search_ops, counter.syncs


def step_costs(model, d, batch: int, args, device: torch.device, repeats: int = 5) -> Dict:
    """One cached step's host cost: counts and time of ``new`` new tokens minus those of ``new // 4``.

    The time is the median over ``repeats`` back-to-back pairs of runs (a shared machine's load
    shifts between pairs more than within one). Syncs are counted twice: with </s> banned until
    the last step (as timed) and with </s> allowed from the first new token (a row may end: the
    search reads which did, every ``--eos-check-interval`` steps), on a model that rarely ends.
    """
    prompt, new, interval = args.prompt, args.new, args.eos_check_interval
    prompts = list(torch.randint(4, len(d), (batch, prompt), generator=torch.Generator().manual_seed(0)))
    lengths = (max(1, new // 4), new)
    steps = lengths[1] - lengths[0]
    gens = [generator(model, d, prompt, n, True, interval) for n in lengths]
    banned = [counts(model, gen, prompts) for gen in gens]
    allowed = [
        counts(model, generator(model, d, prompt, n, True, interval, ban_eos=False), prompts)[2] for n in lengths
    ]
    model_ops, search_ops, syncs = ((b - a) / steps for a, b in zip(*banned))
    pairs = [run_generator(gens[1], prompts, device) - run_generator(gens[0], prompts, device) for _ in range(repeats)]
    return {
        "batch": batch,
        "ms_per_step": 1000 * median(pairs) / steps,
        "model_ops": model_ops,
        "search_ops": search_ops,
        "syncs": syncs,
        "syncs_eos_allowed": (allowed[1] - allowed[0]) / steps,
    }


def profile_steps(model, d, arch: str, args, device: torch.device, report: Report) -> None:
    rows = [step_costs(model, d, b, args, device) for b in args.batch_size or [1]]
    print(
        f"{arch} V={len(d)} {args.dtype} on {device} ({torch.get_num_threads()} threads), cached greedy step "
        f"after a {args.prompt}-token prompt, --eos-check-interval {args.eos_check_interval}; "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'batch':>5} {'ms/step':>9} {'model ops':>10} {'search ops':>11} {'syncs':>6} {'syncs (</s> allowed)':>20}"
        f"  (per step: batch new tokens)"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['ms_per_step']:>9.3f} {r['model_ops']:>10.1f} {r['search_ops']:>11.1f} "
            f"{r['syncs']:>6.2f} {r['syncs_eos_allowed']:>20.2f}"
        )
    report.name = "generate_step"
    emit(report, arch, d, args, rows)


def emit(report: Report, arch: str, d: Dictionary, args: argparse.Namespace, rows: List[Dict], stats=None) -> None:
    """The run's one JSON line: what was measured, on what, under which load."""
    report.emit(
        stats,
        baseline="transformers" if stats else None,
        results=args.results,
        arch=arch,
        vocab=len(d),
        device=str(report.device),
        dtype=args.dtype,
        prompt=args.prompt,
        new=args.new,
        rows=rows,
        eos_check_interval=args.eos_check_interval,
    )


def transformers_twin(model, d: Dictionary, device: torch.device, dtype: torch.dtype):
    """transformers' class for ``model`` with its weights (the family's ``--format hf`` adapter), in eval mode."""
    try:
        import transformers
    except ImportError:
        raise SystemExit("benchmarks/generate.py: --versus-transformers needs transformers: pip install transformers")
    weights = model.hf_weights("auto", d, d.eos(), "")
    cls = getattr(transformers, weights.architecture)
    theirs = cls(cls.config_class(**weights.config))
    theirs.load_state_dict({k: v.float() for k, v in weights.state.items()}, strict=False)
    return theirs.to(device=device, dtype=dtype).eval()


@torch.no_grad()
def versus_transformers(model, d: Dictionary, args, device: torch.device, dtype: torch.dtype) -> Dict[str, Stats]:
    """Cached greedy decoding, batch 1: the toolkit's generator and transformers' ``generate()`` alternated on the
    same prompt (``</s>`` first for transformers too: the toolkit's decoders start from it), every run generating
    ``--new`` tokens."""
    from toolkit import ops

    onednn = ops.select("auto", device)  # the library toolkit-generate puts in force for its process
    theirs = transformers_twin(model, d, device, dtype)
    prompts = torch.randint(d.nspecial, len(d), (1, args.prompt), generator=torch.Generator().manual_seed(0))
    ours_gen = generator(model, d, args.prompt, args.new, True, args.eos_check_interval)
    hf_input = torch.cat([torch.full((1, 1), d.eos()), prompts], dim=1).to(device)

    def toolkit_side():
        ops.restore(onednn)
        return ours_gen.generate(list(prompts.to(device)))[0][0]["tokens"][-args.new - 1 : -1].tolist()

    def transformers_side():
        ops.restore(False)  # transformers in a process of its own runs torch's products
        out = theirs.generate(
            hf_input,
            attention_mask=torch.ones_like(hf_input),
            max_new_tokens=args.new,
            min_new_tokens=args.new,
            do_sample=False,
            num_beams=1,
            use_cache=True,
            pad_token_id=d.pad(),
        )
        return out[0, -args.new :].tolist()

    return alternate({"toolkit": toolkit_side, "transformers": transformers_side}, args.rounds, args.warmup, device)


def decode_versus_transformers(model, d, arch: str, args, device: torch.device, report: Report) -> None:
    stats = versus_transformers(model, d, args, device, DTYPES[args.dtype])
    same = stats["toolkit"].last == stats["transformers"].last
    print(
        f"{arch} V={len(d)} {args.dtype} on {device}, batch 1, {args.prompt}-token prompt + {args.new} new tokens, "
        f"greedy, cached; {args.rounds} alternated rounds after {args.warmup}; load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'':<14}{'tokens/s':>10}{'s (min / median / max)':>28}")
    for name, st in stats.items():
        print(f"{name:<14}{st.rate(args.new):>10.1f}{'':>4}{st.min:.3f} / {st.median:.3f} / {st.max:.3f}")
    speedup = stats["transformers"].median / stats["toolkit"].median
    print(f"toolkit / transformers: {speedup:.2f}x; the same tokens: {same}")
    rows = [{"batch": 1, **{f"{n}_tokens_per_s": st.rate(args.new) for n, st in stats.items()}, "same_tokens": same}]
    report.name = "decode_vs_transformers"
    emit(report, arch, d, args, rows, stats)


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=list(PRESETS), default="gpt2_small")
    p.add_argument("--arch", help="override the preset's architecture")
    p.add_argument("--vocab", type=int, help="vocabulary size (default: the preset's)")
    p.add_argument("--batch-size", type=int, action="append", help="batch size; repeat for several")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    p.add_argument("--new", type=int, default=256, help="tokens to generate")
    p.add_argument("--device", help="cpu or cuda[:i] (default: the preset's)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--threads", type=int, default=2, help="CPU threads")
    p.add_argument("--sample-steps", type=int, default=6, help="no-cache steps timed for the estimate")
    p.add_argument("--full", action="store_true", help="run the no-cache generator end to end")
    p.add_argument(
        "--eos-check-interval",
        type=int,
        default=1,
        help="the cached generator reads which rows ended every this many steps",
    )
    p.add_argument(
        "--profile-step",
        action="store_true",
        help="print the host cost of one cached step (ms, operators, syncs) instead",
    )
    p.add_argument(
        "--versus-transformers",
        action="store_true",
        help="cached batch-1 decoding against transformers' generate() on the same weights instead",
    )
    p.add_argument("--rounds", type=int, default=5, help="--versus-transformers: timed rounds of each")
    p.add_argument("--warmup", type=int, default=1, help="--versus-transformers: untimed rounds first")
    add_results_flag(p)
    return p.parse_args(argv)


def main(argv: List[str]) -> None:
    args = parse_args(argv)
    arch, vocab, batches, device_name, full = PRESETS[args.preset]
    arch, vocab = args.arch or arch, args.vocab or vocab
    device = torch.device(args.device or device_name)
    torch.set_num_threads(args.threads)
    report = Report("generate", device=device, argv=argv)
    model, d = build(arch, vocab, max(1024, args.prompt + args.new + 1), device, DTYPES[args.dtype])
    if args.profile_step:
        return profile_steps(model, d, arch, args, device, report)
    if args.versus_transformers:
        return decode_versus_transformers(model, d, arch, args, device, report)
    rows = [measure(model, d, b, args, full or args.full, device) for b in args.batch_size or batches]
    print(
        f"{arch} V={len(d)} {args.dtype} on {device} ({torch.get_num_threads()} threads), "
        f"{args.prompt}-token prompt + {args.new} new tokens, greedy; load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(f"{'batch':>5} {'cache tok/s':>12} {'no-cache tok/s':>15} {'speedup':>8}  no-cache time")
    for r in rows:
        how = "measured" if r["no_cache_measured"] else "estimated"
        extra = f" (estimate {r['no_cache_estimated_s']:.1f}s)" if r["no_cache_measured"] else ""
        print(
            f"{r['batch']:>5} {r['cache_tokens_per_s']:>12.2f} {r['no_cache_tokens_per_s']:>15.2f} "
            f"{r['speedup']:>7.1f}x  {r['no_cache_s']:.1f}s {how}{extra}"
        )
    emit(report, arch, d, args, rows)


if __name__ == "__main__":
    main(sys.argv[1:])
