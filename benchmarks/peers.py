"""The toolkit against its peers on the same work, in one table (CPU).

    python -m benchmarks.peers                 # the full table: a few minutes on 2 cores
    python -m benchmarks.peers --quick         # tiny shapes, 1 timed round: checks that every row runs

Each pair is alternated (A B A B ...: :func:`benchmarks.timing.alternate`), with the same thread count, shapes and
data; ``--warmup`` rounds
are run and discarded; the median of ``--rounds`` timed rounds is reported with the spread (fastest and
slowest round), so a neighbour process slows both sides alike. Rows:

* training step, toolkit vs transformers' ``LlamaForCausalLM`` and ``GPT2LMHeadModel``: in one process,
  the same config and initial weights (ours exported through the Hugging Face adapters), the same random
  batches, forward + fp32 cross entropy + backward + AdamW (``benchmarks/llama_hf.py``'s step: the toolkit's
  criterion with its fused head and loss; transformers' ``labels=`` loss for Llama, its logits for GPT-2);
* training step, the toolkit's MoE vs transformers' ``Qwen3MoeForCausalLM`` (``benchmarks/moe_vs_hf.py``'s
  pair and shape: its experts in transformers' own default implementation), each side's training path as for
  Llama, no router loss on either (transformers' default);
* training step, the toolkit's DeepSeek-V3 family vs transformers' ``DeepseekV3ForCausalLM`` (``DEEPSEEK_SHAPE``:
  4 x 256, the query low rank, latent attention, 16 experts in 4 groups, a shared expert, the first layer dense),
  each side's training path as for Llama, no router loss on either; ``--only deepseek`` runs this row alone;
* cached greedy generation, ``toolkit.generation.SequenceGenerator`` (the toolkit-generate path) vs
  transformers' ``generate()`` on the exported GPT-2 model, the same prompts, every row generating the
  same number of tokens;
* ``toolkit-train`` vs ``fairseq-train``, ``toolkit-eval-lm`` vs ``fairseq-eval-lm`` on the same
  fairseq-trained checkpoint, ``toolkit-preprocess`` vs ``fairseq-preprocess``: the commands of
  ``benchmarks/fairseq_parity/parity.py`` (same model, flags and WikiText-2 split), timed end to end
  (start-up included) as a user runs them; needs the fairseq 0.12.2 that ``setup.sh`` there builds;
* training throughput, ``toolkit-train`` vs ``fairseq-train`` on ``STEADY_MODEL`` (4 x 256): each tool's own
  logged ``wps``, the median of its ``train_inner`` lines after the first (warm-up) interval.

A peer that is not installed is one skipped row naming how to install it. Writes
``benchmarks/results/peers_cpu.json`` (``--out``) and prints a markdown table, with the machine's
load average beside it, then the JSON line (``"benchmark": "peers"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import re
import shutil
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional

from benchmarks.timing import (
    RESULTS,
    Measured,
    Report,
    Stats,
    add_results_flag,
    alternate,
    median,
    time_call,
    write_text,
)

FAIRSEQ_HOME = os.environ.get("FAIRSEQ_HOME", str(pathlib.Path.home() / ".cache" / "toolkit" / "fairseq-0.12.2"))
FAIRSEQ_INSTALL = "bash benchmarks/fairseq_parity/setup.sh (fairseq 0.12.2 is not pip-installable on Python 3.11)"
TRANSFORMERS_INSTALL = "pip install transformers"
EVALUATED = re.compile(r"Evaluated [\d,]+ tokens in [\d.]+s \(([\d.]+) tokens/s\)")
WPS = re.compile(r'train_inner \| \{.*?"wps": "?([\d.]+)"?')
# The steady-state training row's model: fairseq's transformer_lm at a size where the model, not start-up,
# takes the time (the parity model, 2 x 64, is all start-up); both tools' own flags, the same data.
STEADY_MODEL = [
    "--arch",
    "transformer_lm",
    "--decoder-layers",
    "4",
    "--decoder-embed-dim",
    "256",
    "--decoder-ffn-embed-dim",
    "1024",
    "--decoder-attention-heads",
    "4",
]
STEADY_SHAPE = {"--tokens-per-sample": "256", "--max-tokens": "2048", "--log-interval": "5"}


class Skipped(Exception):
    """A peer that is not installed: the row says how to install it."""


def row(name: str, peer: str, unit: str, work: float, timings: Dict[str, Stats], **extra) -> Dict:
    """One table row: ``work`` units per timed round (tokens, for example) -> a rate per second each side."""
    ours, theirs = timings["toolkit"], timings[peer]
    return {
        "name": name,
        "peer": peer,
        "unit": unit,
        "work": work,
        "toolkit": {**ours.as_dict(), "rate": ours.rate(work)},
        "peer_timing": {**theirs.as_dict(), "rate": theirs.rate(work)},
        "speedup": theirs.median / ours.median,
        **extra,
    }


def transformers_module():
    try:
        import transformers
    except ImportError as e:
        raise Skipped(TRANSFORMERS_INSTALL) from e
    return transformers


def train_steps(ours, theirs, loss_theirs, vocab: int, batch: int, tokens: int, args) -> Dict:
    """The llama_hf step on both models, alternated on the same random batches; ours on the toolkit's own
    training path (the cross_entropy criterion, its fused head and loss)."""
    import torch
    from benchmarks.llama_hf import make_step, on_library, toolkit_loss

    steps = {
        "toolkit": on_library(make_step(ours, toolkit_loss(None)), args.onednn),
        "transformers": on_library(make_step(theirs, loss_theirs), False),
    }
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (batch, tokens + 1), generator=g) for _ in range(args.warmup + args.rounds)]

    def side(name):
        feed = iter(batches)  # both sides see the same batch in the same round
        return lambda: steps[name](next(feed))

    timings = alternate({name: side(name) for name in steps}, args.rounds, args.warmup)
    return {"timings": timings, "last_loss_diff": abs(timings["toolkit"].last - timings["transformers"].last)}


def llama_training(args) -> Dict:
    transformers_module()
    from benchmarks.llama_hf import build_pair, parse

    shape = (
        [
            "--layers",
            "2",
            "--dim",
            "64",
            "--ffn",
            "172",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--vocab",
            "512",
            "--tokens",
            "32",
            "--batch",
            "2",
        ]
        if args.quick
        else []
    )
    cfg = parse(shape + ["--threads", str(args.threads)])
    ours, theirs = build_pair(cfg)
    from benchmarks.llama_hf import (
        transformers_loss,
    )  # transformers' own training path: labels=, its mean cross entropy

    out = train_steps(ours, theirs, transformers_loss, cfg.vocab, cfg.batch, cfg.tokens, args)
    shape_text = f"{cfg.layers}x{cfg.dim}, FFN {cfg.ffn}, {cfg.heads}/{cfg.kv_heads} heads, V {cfg.vocab}, B {cfg.batch} x T {cfg.tokens}"
    return row(
        "training step, Llama",
        "transformers",
        "tokens/s",
        cfg.batch * cfg.tokens,
        out["timings"],
        shape=shape_text,
        last_loss_diff=out["last_loss_diff"],
    )


def moe_training(args) -> Dict:
    """The toolkit's MoE against transformers' ``Qwen3MoeForCausalLM`` (moe_vs_hf.py's pair and shape)."""
    transformers_module()
    from benchmarks.moe_vs_hf import build_pair, parse

    shape = (
        [
            "--layers",
            "2",
            "--dim",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--experts",
            "4",
            "--expert-ffn",
            "64",
            "--vocab",
            "512",
            "--tokens",
            "32",
            "--batch",
            "2",
        ]
        if args.quick
        else []
    )
    cfg = parse(shape + ["--threads", str(args.threads)])
    ours, theirs = build_pair(cfg)
    # each side's own training path, as the Llama row: the toolkit's criterion (its fused head and loss) and
    # transformers' labels= loss. The same math: transformers adds no router loss by default
    # (output_router_logits False), so ours is weighted 0 here (its statistics are still computed).
    ours.cfg = dataclasses.replace(ours.cfg, moe_aux_loss_coef=0.0)
    from benchmarks.llama_hf import transformers_loss

    out = train_steps(ours, theirs, transformers_loss, cfg.vocab, cfg.batch, cfg.tokens, args)
    shape_text = (
        f"{cfg.layers}x{cfg.dim}, {cfg.experts} experts of {cfg.expert_ffn}, top {cfg.top_k}, "
        f"V {cfg.vocab}, B {cfg.batch} x T {cfg.tokens}"
    )
    return row(
        "training step, Qwen3-MoE",
        "transformers",
        "tokens/s",
        cfg.batch * cfg.tokens,
        out["timings"],
        shape=shape_text,
        last_loss_diff=out["last_loss_diff"],
    )


DEEPSEEK_SHAPE = dict(  # a few layers of DeepSeek-V3's kind: q low rank, latent, 4 groups of experts, dense first
    decoder_layers=4,
    decoder_embed_dim=256,
    decoder_ffn_embed_dim=512,
    decoder_attention_heads=8,
    decoder_kv_heads=8,
    q_lora_rank=96,
    kv_lora_rank=64,
    decoder_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    moe_num_experts=16,
    moe_top_k=4,
    moe_n_group=4,
    moe_topk_group=2,
    moe_ffn_embed_dim=128,
    moe_shared_ffn_embed_dim=128,
    first_k_dense_replace=1,
)
DEEPSEEK_QUICK = dict(DEEPSEEK_SHAPE, decoder_layers=2, decoder_embed_dim=64, decoder_ffn_embed_dim=96)


def deepseek_pair(shape: Dict[str, int], vocab: int, tokens: int):
    """Our deepseek_v3 model and transformers' ``DeepseekV3ForCausalLM`` with the same weights: ours written as
    the Hugging Face folder ``--format hf`` writes (rotary rows interleaved, experts one matrix each) and read
    by ``from_pretrained`` (which fuses the experts into its own layout)."""
    import torch
    from safetensors.torch import save_file

    transformers = transformers_module()
    from toolkit.models import model_config
    from toolkit.models.deepseek_v3.hf import DeepSeekV3Adapter, _dims
    from toolkit.models.deepseek_v3.model import DeepSeekV3LanguageModel

    cfg = model_config("deepseek_v3", **shape, max_target_positions=tokens)
    ours = DeepSeekV3LanguageModel(cfg, vocab, padding_idx=1, seed=1)
    adapter = DeepSeekV3Adapter()
    adapter.dims = _dims(vars(cfg))
    _, config = adapter.hf_config(cfg, vocab)
    with tempfile.TemporaryDirectory(prefix="deepseek-") as folder:
        state = {k: v.contiguous() for k, v in adapter.state_to_hf(ours.state_dict(), "deepseek_v3").items()}
        save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({**config, "architectures": ["DeepseekV3ForCausalLM"]}, f)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return ours.train(), theirs.train()


def deepseek_training(args) -> Dict:
    """The toolkit's DeepSeek-V3 family against transformers' ``DeepseekV3ForCausalLM``: each side's training path
    as for Llama (the toolkit's criterion; transformers' ``labels=`` loss), no router loss on either."""
    from benchmarks.llama_hf import transformers_loss

    shape, vocab, batch, tokens = (DEEPSEEK_QUICK, 512, 2, 32) if args.quick else (DEEPSEEK_SHAPE, 8192, 8, 256)
    ours, theirs = deepseek_pair(shape, vocab, tokens)
    out = train_steps(ours, theirs, transformers_loss, vocab, batch, tokens, args)
    shape_text = (
        f"{shape['decoder_layers']}x{shape['decoder_embed_dim']}, MLA (q rank {shape['q_lora_rank']}, latent "
        f"{shape['kv_lora_rank']}), {shape['moe_num_experts']} experts of {shape['moe_ffn_embed_dim']} in "
        f"{shape['moe_n_group']} groups, top {shape['moe_top_k']}, V {vocab}, B {batch} x T {tokens}"
    )
    return row(
        "training step, DeepSeek-V3",
        "transformers",
        "tokens/s",
        batch * tokens,
        out["timings"],
        shape=shape_text,
        last_loss_diff=out["last_loss_diff"],
    )


def gpt2_pair(layers: int, dim: int, heads: int, vocab: int, positions: int):
    """Our transformer_lm with GPT-2's layout and transformers' GPT2LMHeadModel with the same weights."""
    transformers = transformers_module()
    from toolkit.core import registry
    from toolkit.config import options
    from toolkit.data.dictionary import Dictionary
    from toolkit.models.transformer_lm.hf import hf_weights

    registry.import_all_components()
    entry = registry.resolve_arch("transformer_lm_gpt2_small")
    values = options.architecture_defaults(
        "transformer_lm_gpt2_small",
        {
            "max_target_positions": positions,
            "decoder_layers": layers,
            "decoder_embed_dim": dim,
            "decoder_ffn_embed_dim": 4 * dim,
            "decoder_attention_heads": heads,
            # GPT-2's own layout (what toolkit-export --format hf needs for GPT2LMHeadModel); no dropout, so
            # both sides compute the same loss
            "decoder_learned_pos": True,
            "no_scale_embedding": True,
            "share_decoder_input_output_embed": True,
            "dropout": 0.0,
            "attention_dropout": 0.0,
        },
    )
    d = Dictionary()
    for i in range(vocab - len(d)):
        d.add_symbol(f"w{i}")
    model = entry.cls(options.config_from_args(entry.config, values), len(d), d.pad(), seed=0)
    weights = hf_weights(model, "gpt2", d, d.eos())
    config = getattr(transformers, weights.architecture).config_class(**weights.config)
    theirs = getattr(transformers, weights.architecture)(config)
    theirs.load_state_dict(weights.state, strict=False)
    return model, theirs, d


def gpt2_shape(args):
    return (2, 64, 4, 512, 32, 2) if args.quick else (4, 256, 4, 8192, 256, 8)


def gpt2_training(args) -> Dict:
    layers, dim, heads, vocab, tokens, batch = gpt2_shape(args)
    ours, theirs, d = gpt2_pair(layers, dim, heads, vocab, tokens + 1)
    ours.train(), theirs.train()
    from benchmarks.llama_hf import logits_loss

    out = train_steps(
        ours, theirs, logits_loss(lambda m, x: m(input_ids=x, use_cache=False).logits), len(d), batch, tokens, args
    )
    return row(
        "training step, GPT-2",
        "transformers",
        "tokens/s",
        batch * tokens,
        out["timings"],
        shape=f"{layers}x{dim}, FFN {4 * dim}, {heads} heads, V {len(d)}, B {batch} x T {tokens}",
        last_loss_diff=out["last_loss_diff"],
    )


def generation(args) -> Dict:
    """Cached greedy decoding of ``new`` tokens after a random prompt, every row the same length."""
    import torch
    from benchmarks.generate import generator

    from toolkit import ops

    layers, dim, heads, vocab, _, _ = gpt2_shape(args)
    prompt, new = (8, 8) if args.quick else (64, 128)
    ours, theirs, d = gpt2_pair(layers, dim, heads, vocab, prompt + new + 2)
    ours.eval(), theirs.eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(d.nspecial, len(d), (1, prompt), generator=g)
    ours_gen = generator(ours, d, prompt, new, incremental=True)
    # transformers sees the same input our generator builds: </s> first (fairseq LMs' start symbol).
    hf_input = torch.cat([torch.full((1, 1), d.eos()), prompts], dim=1)

    def toolkit_side():
        ops.restore(args.onednn)  # as toolkit-generate sets it for its process
        with torch.no_grad():
            return ours_gen.generate(list(prompts))

    def hf_side():
        ops.restore(False)  # transformers in this process: torch's products, as its own code runs
        with torch.no_grad():
            return theirs.generate(
                hf_input,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                num_beams=1,
                use_cache=True,
                pad_token_id=d.pad(),
            )

    timings = alternate({"toolkit": toolkit_side, "transformers": hf_side}, args.rounds, args.warmup)
    return row(
        "cached greedy generation, GPT-2 (batch 1)",
        "transformers",
        "new tokens/s",
        new,
        timings,
        shape=f"{layers}x{dim}, V {len(d)}, prompt {prompt}, {new} new tokens",
    )


class FairseqPair:
    """The parity script's commands, on the parity split, fairseq's and ours in turn."""

    def __init__(self, args, work: pathlib.Path):
        home = pathlib.Path(args.fairseq_home)
        if not (home / "venv" / "bin" / "python").exists() or not (home / "src" / "fairseq").is_dir():
            raise Skipped(FAIRSEQ_INSTALL)
        from benchmarks.fairseq_parity import parity

        self.parity = parity
        self.runner = parity.Runner(work, home)
        self.work = work
        self.data = str(work / "fairseq-bin")
        self.threads = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
        for env in (self.runner.fairseq_env, self.runner.toolkit_env):
            env.update(self.threads)
        self.updates = 4 if args.quick else 40
        self.steady_updates = 10 if args.quick else 30

    def command(self, side: str, tool: str, *argv: str) -> Callable[[], Any]:
        run = self.runner.fairseq if side == "fairseq" else self.runner.toolkit
        return lambda: run(tool, *argv)

    def preprocess(self, side: str) -> Callable[[], Any]:
        data = self.parity.DATA
        splits = [
            "--trainpref",
            str(data / "wiki.train.tokens"),
            "--validpref",
            str(data / "wiki.valid.tokens"),
            "--testpref",
            str(data / "wiki.test.tokens"),
            "--workers",
            "1",
            "--only-source",
        ]
        dest = self.work / f"{side}-bin"

        def run():
            shutil.rmtree(dest, ignore_errors=True)
            return self.command(side, "preprocess", *splits, "--destdir", str(dest))()

        return run

    def train(self, side: str) -> Callable[[], Any]:
        p = self.parity
        return self.command(
            side,
            "train",
            self.data,
            *p.MODEL,
            *p.TRAIN,
            "--max-update",
            str(self.updates),
            "--save-dir",
            str(self.work / f"{side}-ckpt"),
            "--no-save",
        )

    def steady_train(self, side: str, rates: Dict[str, List[float]]) -> Callable[[], Measured]:
        """Training throughput as each tool logs it: the median ``wps`` of its ``train_inner`` lines after the
        first interval (warm-up), on ``STEADY_MODEL``. A round measures seconds per million words."""
        flags = list(self.parity.TRAIN)
        for flag, value in STEADY_SHAPE.items():
            flags[flags.index(flag) + 1] = value
        run = self.runner.fairseq if side == "fairseq" else self.runner.toolkit

        def timed_train():
            output = run(
                "train",
                self.data,
                *STEADY_MODEL,
                *flags,
                "--max-update",
                str(self.steady_updates),
                "--save-dir",
                str(self.work / f"{side}-steady"),
                "--no-save",
            )
            wps = [float(w) for w in WPS.findall(output)][1:]
            if not wps:
                sys.exit(f"peers: no train_inner wps after the first interval in {side}'s output:\n{output[-2000:]}")
            rates.setdefault(side, []).append(median(wps))
            return Measured(1e6 / rates[side][-1])

        return timed_train

    def eval_lm(self, side: str, checkpoint: str, loop_rates: Dict[str, List[float]]) -> Callable[[], Measured]:
        """The whole command timed; the scoring loop's own tokens/s (its "Evaluated N tokens in Xs" line,
        the same in both) kept in ``loop_rates``: on a small model the command is mostly start-up."""
        run = self.runner.fairseq if side == "fairseq" else self.runner.toolkit

        def timed_eval():
            seconds, output = time_call(
                lambda: run(
                    "eval_lm",
                    self.data,
                    "--path",
                    checkpoint,
                    "--gen-subset",
                    "test",
                    "--tokens-per-sample",
                    "64",
                    "--max-tokens",
                    "4096",
                    "--cpu",
                )
            )
            loop_rates.setdefault(side, []).append(float(EVALUATED.findall(output)[-1]))
            return Measured(seconds)

        return timed_eval


def fairseq_rows(args, work: pathlib.Path) -> List[Dict]:
    pair = FairseqPair(args, work)
    tokens = sum(len(line.split()) + 1 for line in open(pair.parity.DATA / "wiki.train.tokens", encoding="utf-8"))
    pre = alternate(
        {"toolkit": pair.preprocess("toolkit"), "fairseq": pair.preprocess("fairseq")}, args.rounds, args.warmup
    )
    rows = [
        row(
            "preprocess (whitespace, 1 worker; train split)",
            "fairseq",
            "train tokens/s",
            tokens,
            pre,
            note="end to end, start-up included; train+valid+test written",
        )
    ]
    train = alternate({"toolkit": pair.train("toolkit"), "fairseq": pair.train("fairseq")}, args.rounds, args.warmup)
    rows.append(
        row(
            "toolkit-train vs fairseq-train (parity model, 2x64)",
            "fairseq",
            "updates/s",
            pair.updates,
            train,
            note="whole command, start-up included",
        )
    )
    steady_rates: Dict[str, List[float]] = {}
    steady = alternate(
        {"toolkit": pair.steady_train("toolkit", steady_rates), "fairseq": pair.steady_train("fairseq", steady_rates)},
        args.rounds,
        args.warmup,
    )
    rows.append(
        row(
            "training throughput, toolkit-train vs fairseq-train",
            "fairseq",
            "words/s",
            1e6,
            steady,
            shape="transformer_lm 4x256, FFN 1024, 4 heads, T 256, 2048 tokens an update, fp32; each "
            "tool's logged wps, median after the first interval",
        )
    )
    save = work / "fairseq-ckpt-for-eval"
    pair.runner.fairseq(
        "train",
        pair.data,
        *pair.parity.MODEL,
        *pair.parity.TRAIN,
        "--max-update",
        str(pair.updates),
        "--save-dir",
        str(save),
    )
    ckpt = str(save / "checkpoint_last.pt")
    test_tokens = sum(len(line.split()) + 1 for line in open(pair.parity.DATA / "wiki.test.tokens", encoding="utf-8"))
    loop_rates: Dict[str, List[float]] = {}
    evals = alternate(
        {"toolkit": pair.eval_lm("toolkit", ckpt, loop_rates), "fairseq": pair.eval_lm("fairseq", ckpt, loop_rates)},
        args.rounds,
        args.warmup,
    )
    loop = {side: median(rates[args.warmup :]) for side, rates in loop_rates.items()}
    rows.append(
        row(
            "eval-lm on the same fairseq checkpoint (test split)",
            "fairseq",
            "tokens/s",
            test_tokens,
            evals,
            note=f"whole command, start-up included; scoring loop alone {loop['toolkit']:,.0f} vs "
            f"{loop['fairseq']:,.0f} tokens/s = {loop['toolkit'] / loop['fairseq']:.2f}x",
            loop_tokens_per_s=loop,
        )
    )
    return rows


def load() -> str:
    try:
        one, five, _ = os.getloadavg()
        return f"load average {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"
    except OSError:
        return "load average unknown"


def markdown(result: Dict) -> str:
    lines = [
        f"{result['machine']}; torch {result['torch']}, {result['threads']} threads, toolkit fp32 matmuls by "
        f"{result.get('cpu_matmul', 'torch')}; "
        f"{result['rounds']} alternated rounds after {result['warmup']} warm-up; {result['load_before']} before, "
        f"{result['load_after']} after",
        "",
        "| work | peer | toolkit | peer | toolkit / peer | spread (toolkit; peer, s) |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['name']} | {r['peer']} | skipped: {r['skipped']} | | | |")
            continue
        t, p = r["toolkit"], r["peer_timing"]
        lines.append(
            f"| {r['name']} ({r.get('shape', r.get('note', ''))}) | {r['peer']} | {t['rate']:,.1f} {r['unit']} | "
            f"{p['rate']:,.1f} {r['unit']} | {r['speedup']:.2f}x | {t['min_s']:.3f}-{t['max_s']:.3f}; "
            f"{p['min_s']:.3f}-{p['max_s']:.3f} |"
        )
    return "\n".join(lines)


def run_rows(args, work: pathlib.Path) -> List[Dict]:
    rows: List[Dict] = []
    for name, peer, fn in (
        ("training step, Llama", "transformers", llama_training),
        ("training step, Qwen3-MoE", "transformers", moe_training),
        ("training step, DeepSeek-V3", "transformers", deepseek_training),
        ("training step, GPT-2", "transformers", gpt2_training),
        ("cached greedy generation, GPT-2", "transformers", generation),
    ):
        if args.only and args.only.lower() not in name.lower():
            continue
        try:
            rows.append(fn(args))
        except Skipped as s:
            rows.append({"name": name, "peer": peer, "skipped": str(s)})
        print(markdown_row_progress(rows[-1]), flush=True)
    if args.only:
        return rows
    try:
        rows.extend(fairseq_rows(args, work))
    except Skipped as s:
        rows.extend(
            {"name": name, "peer": "fairseq 0.12.2", "skipped": str(s)}
            for name in ("preprocess", "toolkit-train vs fairseq-train", "eval-lm vs fairseq-eval-lm")
        )
    return rows


def markdown_row_progress(r: Dict) -> str:
    return f"[peers] {r['name']}: " + (f"skipped ({r['skipped']})" if "skipped" in r else f"{r['speedup']:.2f}x")


def main(argv: Optional[List[str]] = None) -> Dict:
    from toolkit.config import CPU_MATMUL_CHOICES  # the commands' --cpu-matmul (no torch import)

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, one timed round (a check, not a figure)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 1)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; --quick 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fairseq-home", default=FAIRSEQ_HOME)
    ap.add_argument(
        "--only", default=None, help="run only the in-process rows whose name contains this (e.g. deepseek)"
    )
    ap.add_argument(
        "--cpu-matmul",
        default="auto",
        choices=CPU_MATMUL_CHOICES,
        help="the toolkit side's fp32 matmul library in the in-process rows, as its commands' "
        "--cpu-matmul (the toolkit commands of the fairseq rows use their default, auto)",
    )
    ap.add_argument("--out", default=str(RESULTS / "peers_cpu.json"))
    add_results_flag(ap)
    args = ap.parse_args(argv)
    args.warmup = 1 if args.warmup is None else args.warmup
    args.rounds = args.rounds or (1 if args.quick else 5)
    import torch

    from toolkit import ops

    torch.set_num_threads(args.threads)
    report = Report("peers", argv=argv)
    onednn = ops.select(args.cpu_matmul)  # the toolkit side's fp32 matmul library, as its commands choose it
    args.onednn = onednn
    ops.restore(False)  # peers in this process run torch's; a toolkit side here sets its own (generation)
    before = load()
    with tempfile.TemporaryDirectory(prefix="peers-") as work:
        rows = run_rows(args, pathlib.Path(work))
    result = {
        "benchmark": "peers",
        "quick": args.quick,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "threads": args.threads,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "cpu_matmul": "onednn" if onednn else "torch",
        "load_before": before,
        "load_after": load(),
        "rows": rows,
    }
    result["markdown"] = markdown(result)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text(str(out), json.dumps(result, indent=1))
    print(result["markdown"])
    report.emit(results=args.results, **{k: v for k, v in result.items() if k not in ("benchmark", "markdown")})
    return result


if __name__ == "__main__":
    main()
