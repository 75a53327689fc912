"""Training throughput and MFU of ``Trainer.train_step`` on synthetic tokens.

    python -m benchmarks.train                                   # small: 4x256, FFN 1024, 4 heads, T 256, B 8, V 8192
    python -m benchmarks.train --preset gpt3_small               # transformer_lm_gpt3_small, shorter run
    python -m benchmarks.train --preset gpt3_xl --device cuda --bf16   # on a GPU
    python -m benchmarks.train --preset llama3_1b --device cuda --bf16 --compile --ddp-backend fully_sharded
    python -m benchmarks.train --arch transformer_lm --decoder-layers 2 ... # any toolkit-train model flags

What runs is the real training path: the options are parsed by toolkit-train's parser,
the model is built by ``toolkit.distributed.parallelize.build_parallel_model`` (meta device,
materialize, ``init_weights``), the criterion by the task, and every step is one
``Trainer.train_step([sample])`` (criterion forward, backward, gradient normalization
and norm, AdamW step, zero_grad, LR schedule, metrics), inside the same
``metrics.aggregate`` blocks as toolkit-train.
Only the data is synthetic: uniformly random tokens, every row full (no padding),
``B x T`` per step.

``--warmup`` steps are run and discarded, then ``--steps`` steps are timed one by one
(:func:`benchmarks.timing.repeat`: CUDA-synchronized on a GPU).
The time split comes from hooks on the same timed steps (no extra synchronization on
CPU; CUDA events on GPU): forward = step start until the criterion returns the loss;
backward = until the last parameter gradient is accumulated; grad norm = gradient
normalization and clipping norm; optimizer = ``optimizer.step()``; other = the rest
(zero_grad, LR schedule, logging).

FLOPs per token are the model's own ``flops_per_token(T)`` = 6N + 12·L·d·T (N = weights in
matmuls, output projection included). The peak is ``toolkit.logging.throughput.peak_flops``:
what toolkit-train's MFU uses (the datasheet on known GPUs; on CPU the best rate of large
square matmuls, ``measure_matmul_flops``). On CPU the same measurement is repeated after the
timed steps and the higher of the two is used, so a neighbour process during the first one
cannot inflate the MFU. MFU = tokens/s x FLOPs/token / peak, reported for the median step
(the typical figure) and the fastest step (the least disturbed one on a shared machine).

``--fp8-experts`` runs the MoE experts' grouped GEMMs in float8 through torchao's MoE training recipe
(``torchao.prototype.moe_training``: the expert weights wrapped so that ``torch._grouped_mm`` quantizes its
operands rowwise and runs the scaled grouped GEMM; CUDA, SM 9.0 and later), the rest of the model as it is.

Prints a table and one JSON line (``"benchmark": "train_step"``, :class:`benchmarks.timing.Report`).
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import torch

from benchmarks.timing import Report, add_results_flag, cpu_now, median, now, repeat

PRESETS = {
    # name: (toolkit-train model/batch flags, vocabulary size, warmup steps, timed steps)
    "small": (
        [
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
            "--decoder-input-dim",
            "256",
            "--decoder-output-dim",
            "256",
            "--decoder-normalize-before",
            "--tokens-per-sample",
            "256",
            "--batch-size",
            "8",
        ],
        8192,
        3,
        10,
    ),
    "gpt3_small": (
        ["--arch", "transformer_lm_gpt3_small", "--tokens-per-sample", "256", "--batch-size", "8"],
        8192,
        1,
        3,
    ),
    # GPT-2 BPE dictionary as fairseq pads it (50264); sized for one 80 GB GPU without checkpointing.
    "gpt3_xl": (["--arch", "transformer_lm_gpt3_xl", "--tokens-per-sample", "2048", "--batch-size", "4"], 50264, 3, 10),
    # Llama 3.2 1B (1.236B parameters, tied) at its own vocabulary (128256) and batch 4 x 2048.
    "llama3_1b": (["--arch", "llama3_1b", "--tokens-per-sample", "2048", "--batch-size", "4"], 128256, 3, 10),
}
PHASES = ("forward", "backward", "grad_norm", "optimizer", "other")


def busy_cpu_seconds():
    """CPU-seconds all processes have run since boot (/proc/stat), or None where unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
        # user nice system idle iowait irq softirq steal ...: everything but idle and iowait
        jiffies = sum(int(x) for i, x in enumerate(fields[:8]) if i not in (3, 4))
        return jiffies / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def parse(argv):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument(
        "--preset",
        choices=list(PRESETS),
        default="small",
        help="model and batch shape (default: small); later flags override it",
    )
    ap.add_argument("--vocab", type=int, default=None, help="dictionary size (specials included)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: per preset)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default: per preset)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default: cpu)")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: 2 on CPU, torch's default on GPU)"
    )
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast, as toolkit-train --bf16")
    ap.add_argument("--fp16", action="store_true", help="fp16 autocast with loss scaling, as toolkit-train --fp16")
    ap.add_argument(
        "--profile", metavar="FILE", default=None, help="also write a torch.profiler table of one extra step to FILE"
    )
    ap.add_argument(
        "--fp8-experts",
        action="store_true",
        help="the MoE experts' grouped GEMMs in float8 (torchao's MoE training recipe, rowwise; CUDA)",
    )
    ap.add_argument(
        "--no-peak-after",
        dest="peak_after",
        action="store_false",
        help="on a CPU, the peak as measured before the run only, not again after it (a second of large matmuls:"
        " gpu.sh's dry run, whose figures are no measurement)",
    )
    add_results_flag(ap)
    ours, rest = ap.parse_known_args(argv)
    preset_flags, vocab, warmup, steps = PRESETS[ours.preset]
    ours.vocab = ours.vocab or vocab
    ours.warmup = warmup if ours.warmup is None else ours.warmup
    ours.steps = steps if ours.steps is None else ours.steps
    train_argv = preset_flags + rest  # argparse keeps a flag's last value: the user's flags win
    return ours, train_argv


def build(ours, train_argv):
    """Options through toolkit-train's parser; task, model, criterion, Trainer as toolkit-train builds them."""
    from toolkit.data.dictionary import Dictionary
    from toolkit.distributed.parallelize import build_parallel_model
    from toolkit.distributed.utils import DistributedEnv, init_distributed
    from toolkit.core.registry import CRITERION_REGISTRY
    from toolkit.train.resolve import parse_train_config
    from toolkit.tasks.language_modeling import LanguageModelingTask
    from toolkit.train.train_loop import choose_cpu_matmul
    from toolkit.train.trainer import Trainer

    device = torch.device(ours.device)
    argv = [
        "synthetic",
        "--task",
        "language_modeling",
        "--optimizer",
        "adam",
        "--lr",
        "1e-4",
        "--num-workers",
        "0",
        "--seed",
        "1",
        *train_argv,
    ]
    if device.type == "cpu":
        argv.append("--cpu")
    if ours.bf16:
        argv.append("--bf16")
    if ours.fp16:
        argv.append("--fp16")
    cfg = parse_train_config(argv)
    args = SimpleNamespace(**cfg.to_dict())  # flat view, for the report
    if args.update_freq != 1:
        raise SystemExit("benchmarks/train.py: --update-freq is not supported (one micro-batch per step)")
    dictionary = Dictionary()
    while len(dictionary) < ours.vocab:
        dictionary.add_symbol(f"w{len(dictionary)}")
    task = LanguageModelingTask(cfg.task, dictionary)
    torch.manual_seed(args.seed)
    if args.ddp_backend == "fully_sharded":
        # FSDP2 needs a process group even for one rank: the one toolkit-train makes.
        os.environ.setdefault("LOCAL_RANK", str(device.index or 0))
        env = init_distributed(cfg.distributed, cpu=cfg.common.cpu)
    else:
        env = DistributedEnv(device=device)
    choose_cpu_matmul(cfg.common.cpu_matmul, env)  # fp32 CPU products: oneDNN or torch's, as toolkit-train
    model, strategy = build_parallel_model(cfg, task, env)
    if ours.fp8_experts:
        float8_experts(model, args)  # before the optimizer takes the parameters
    criterion = CRITERION_REGISTRY.get(cfg.components.criterion).cls(task, cfg.criterion)
    trainer = Trainer(cfg, task, model, criterion, env, strategy)
    return args, task, model, criterion, trainer


def float8_experts(model, args) -> None:
    """The experts' weights wrapped by torchao's MoE training recipe (``Float8TrainingOpConfig``, rowwise): their
    ``torch._grouped_mm`` quantizes both operands to float8 and runs the scaled grouped GEMM; master weights and
    gradients keep their dtype."""
    if args.ddp_backend == "fully_sharded":
        raise SystemExit("benchmarks/train.py: --fp8-experts wraps the weights after the build; drop --ddp-backend")
    try:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization import quantize_
    except ImportError:
        raise SystemExit(
            "benchmarks/train.py: --fp8-experts needs torchao's MoE training recipe "
            "(torchao.prototype.moe_training, torchao >= 0.14): pip install torchao"
        ) from None
    from toolkit.models.blocks.moe import GroupedExperts

    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    if not experts:
        raise SystemExit(f"benchmarks/train.py: --fp8-experts: {args.arch} has no MoE experts")
    quantize_(model, Float8TrainingOpConfig(), filter_fn=lambda module, _: isinstance(module, GroupedExperts))


def synthetic_sample(args, dictionary, device, seed: int = 0):
    B, T = args.batch_size, args.tokens_per_sample
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (B, T + 1), generator=g)
    return {
        "id": torch.arange(B),
        "nsentences": B,
        "ntokens": B * T,
        "net_input": {
            "src_tokens": tokens[:, :-1].contiguous().to(device),
            "src_lengths": torch.full((B,), T, dtype=torch.long),
        },
        "target": tokens[:, 1:].contiguous().to(device),
    }


class PhaseTimer:
    """Time marks inside ``train_step`` from hooks: criterion output, last gradient, optimizer step."""

    def __init__(self, trainer, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = {}
        self.handles = [
            trainer.criterion.register_forward_hook(lambda *a: self.mark("forward")),
            trainer.optimizer.register_step_pre_hook(lambda *a: self.mark("grad_norm")),
            trainer.optimizer.register_step_post_hook(lambda *a: self.mark("optimizer")),
        ]
        for p in trainer.model.parameters():
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(lambda *a: self.mark("backward")))

    def mark(self, name: str) -> None:
        """Record mark ``name``: a CUDA event on GPU, the benchmarks' clock on CPU (returns None: a forward hook's
        return value would replace the criterion's output)."""
        if self.cuda:
            ev = self.marks.get(name)
            if ev is None:
                ev = self.marks[name] = torch.cuda.Event(enable_timing=True)
            ev.record()  # re-recording keeps the latest (the last gradient for "backward")
        else:
            self.marks[name] = now()

    def stamp(self, name: str):
        """Record mark ``name`` and return it."""
        self.mark(name)
        return self.marks[name]

    def split(self, start, end):
        """Seconds per phase between ``start`` and ``end`` (marks, as recorded)."""
        # A mark that never fired (FSDP2 assigns sharded gradients after reduce-scatter, so the
        # per-parameter hooks do not run) counts as zero time: its phase goes to the next one.
        order = [
            k
            for k in ("start", "forward", "backward", "grad_norm", "optimizer", "end")
            if k in ("start", "end") or k in self.marks
        ]
        marks = dict(self.marks, start=start, end=end)
        if self.cuda:
            torch.cuda.synchronize()
            t = [0.0]
            for a, b in zip(order, order[1:]):
                t.append(t[-1] + marks[a].elapsed_time(marks[b]) / 1e3)
        else:
            t = [marks[k] - marks["start"] for k in order]
        at = dict(zip(order, t))
        out, prev = {}, 0.0
        for ph in PHASES:
            key = "end" if ph == "other" else ph
            if key in at:
                out[ph], prev = at[key] - prev, at[key]
            else:
                out[ph] = 0.0
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def run_steps(trainer, sample, n: int, device: torch.device, phases: bool, warmup: int = 0):
    """``warmup`` untimed steps, then ``n`` timed ones: (their :class:`~benchmarks.timing.Stats`, the phase split
    of each timed step, the last step's logging output, the peak GPU memory of each step)."""
    from toolkit.logging import metrics

    timer = PhaseTimer(trainer, device) if phases else None
    splits, peaks, calls = [], [], []

    def step():
        calls.append(None)
        start = timer.stamp("start") if timer else None
        with metrics.aggregate("train_inner"):
            out = trainer.train_step([sample])
        if out is None and phases and len(calls) > warmup:
            raise RuntimeError(
                "train_step skipped a timed update (fp16 overflow); add --warmup steps or lower --fp16-init-scale"
            )
        if timer:
            splits.append(timer.split(start, timer.stamp("end")))
        gb_free = metrics.get_smoothed_values("train_inner").get("gb_free")  # the step's peak (CUDA only)
        if gb_free is not None:
            peaks.append(torch.cuda.get_device_properties(device).total_memory / 2**30 - gb_free)
        metrics.reset_meters("train_inner")
        return out

    with metrics.aggregate("train"):
        stats = repeat(step, n, warmup, device)
    if timer:
        timer.remove()
    return stats, splits[warmup:], stats.last, peaks[warmup:]


def main(argv=None):
    ours, train_argv = parse(argv)
    device = torch.device(ours.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        ours.device = str(device)
    threads = ours.threads or (2 if device.type == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    report = Report("train_step", device=device, argv=argv)
    load_before = os.getloadavg()

    from toolkit.logging import throughput

    args, task, model, criterion, trainer = build(ours, train_argv)
    dtype = trainer.compute_dtype
    fpt = model.flops_per_token(args.tokens_per_sample)
    n_matmul = model.num_matmul_parameters()
    n_params = sum(p.numel() for p in model.parameters())
    peak = throughput.peak_flops(device, dtype)  # what toolkit-train's MFU is measured against
    sample = synthetic_sample(args, task.dictionary, device)
    tokens = sample["ntokens"]

    if ours.warmup:
        run_steps(trainer, sample, ours.warmup, device, phases=False)
    busy0, own0, wall0 = busy_cpu_seconds(), cpu_now(), now()
    stats, splits, out, peaks = run_steps(trainer, sample, ours.steps, device, phases=True)
    busy1, own1, wall1 = busy_cpu_seconds(), cpu_now(), now()
    times = stats.seconds
    # CPUs' worth of other processes' work during the timed steps (this process's own CPU time excluded)
    others = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0) - (own1 - own0)) / (wall1 - wall0)
    if ours.profile:
        from torch.profiler import profile, ProfilerActivity

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts, record_shapes=True) as prof:
            run_steps(trainer, sample, 1, device, phases=False)
        sorts = (["self_cuda_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]
        with open(ours.profile, "w") as f:
            for sort in sorts:  # on GPU also by CPU time: host-side work (offloaded optimizer, syncs) shows there
                f.write(f"sorted by {sort}\n")
                f.write(prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=45) + "\n")
    if device.type == "cpu" and ours.peak_after:
        # The same measurement again after the run, the higher of the two counts: a neighbour
        # process during either one lowers the peak, which would inflate the MFU.
        peak_after = throughput.best_matmul_flops(device, dtype)
        peak_used = max(peak, peak_after)
    else:
        peak_after = peak_used = peak
    load_after = os.getloadavg()

    med, best = stats.median, stats.min

    def figures(step_s):
        tps = tokens / step_s
        return {
            "step_ms": 1e3 * step_s,
            "tokens_per_s": tps,
            "achieved_tflops": tps * fpt / 1e12,
            "mfu": throughput.mfu(tps * fpt, peak_used),
        }

    res = {"median": figures(med), "best": figures(best)}
    split = {ph: median([s[ph] for s in splits]) for ph in PHASES}
    split_total = sum(split.values())
    cfg = model.cfg
    desc = (
        f"{args.arch}: L={cfg.decoder_layers} d={cfg.decoder_embed_dim} H={cfg.decoder_attention_heads} "
        f"ffn={cfg.decoder_ffn_embed_dim} T={args.tokens_per_sample} B={args.batch_size} V={len(task.dictionary)} "
        f"{str(dtype).replace('torch.', '')} on {device}"
        + (
            f" ({torch.get_num_threads()} threads)"
            if device.type == "cpu"
            else f" ({torch.cuda.get_device_name(device)})"
        )
    )
    print(desc)
    print(
        f"params {n_params / 1e6:.2f}M, matmul params N {n_matmul / 1e6:.2f}M, "
        f"FLOPs/token {fpt / 1e6:.1f}M (6N + 12LdT), {tokens} tokens/step, "
        f"warmup {ours.warmup}, timed steps {ours.steps}, final loss {out['loss'] / tokens / 0.6931:.3f} bits"
    )
    if device.type == "cpu" and ours.peak_after:
        how = f"best matmul rate, measured {peak / 1e9:.1f} before and {peak_after / 1e9:.1f} GFLOP/s after the run"
    else:
        how = "toolkit.logging.throughput.peak_flops"
    print(
        f"peak {peak_used / 1e12:.3f} TFLOP/s ({how}); "
        f"load average {load_before[0]:.2f} -> {load_after[0]:.2f} on {os.cpu_count()} CPUs"
        + ("" if others is None else f"; other processes used {others:.2f} CPUs during the timed steps")
    )
    print(f"{'':<8}{'step ms':>10}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}")
    for k, r in res.items():
        m = "n/a" if r["mfu"] is None else f"{r['mfu']:.3f}"
        print(f"{k:<8}{r['step_ms']:>10.1f}{r['tokens_per_s']:>12,.0f}{r['achieved_tflops']:>10.4f}{m:>8}")
    # Other processes' CPU use during the timed steps (the load average also counts this benchmark
    # and lags by a minute, so it is only the fallback).
    cpus = os.cpu_count() or 1
    if others is not None:
        busy = device.type == "cpu" and others > 0.25
    else:
        busy = device.type == "cpu" and load_before[0] > cpus - threads + 1.0
    if busy or any(r["mfu"] is not None and r["mfu"] > 1 for r in res.values()):
        print(
            "WARNING: other processes were using the CPUs; the step times and the measured peak are both "
            "disturbed, so these figures (MFU especially) are unreliable: rerun when the machine is idle"
        )
    peak_gib = max(peaks) if peaks else None
    if peak_gib is not None:
        print(
            f"peak GPU memory allocated during a step: {peak_gib:.2f} GiB "
            f"(of {torch.cuda.get_device_properties(device).total_memory / 2**30:.1f}; reserved by the caching "
            f"allocator: {torch.cuda.max_memory_reserved(device) / 2**30:.2f} GiB)"
        )
    print(
        "time split (median over timed steps): "
        + ", ".join(f"{ph} {1e3 * split[ph]:.1f} ms ({100 * split[ph] / split_total:.0f}%)" for ph in PHASES)
    )
    report.emit(
        {"step": stats},
        results=ours.results,
        preset=ours.preset,
        arch=args.arch,
        layers=cfg.decoder_layers,
        embed_dim=cfg.decoder_embed_dim,
        heads=cfg.decoder_attention_heads,
        ffn_dim=cfg.decoder_ffn_embed_dim,
        tokens_per_sample=args.tokens_per_sample,
        batch_size=args.batch_size,
        vocab=len(task.dictionary),
        dtype=str(dtype).replace("torch.", ""),
        device=str(device),
        threads=torch.get_num_threads(),
        params=n_params,
        matmul_params=n_matmul,
        flops_per_token=fpt,
        tokens_per_step=tokens,
        warmup=ours.warmup,
        steps=ours.steps,
        peak_flops=peak_used,
        peak_flops_before=peak,
        peak_flops_after=peak_after,
        tokens_per_s=res["median"]["tokens_per_s"],
        achieved_flops=res["median"]["achieved_tflops"] * 1e12,
        mfu=res["median"]["mfu"],
        best_tokens_per_s=res["best"]["tokens_per_s"],
        best_mfu=res["best"]["mfu"],
        step_ms_all=[round(1e3 * t, 2) for t in times],
        split_ms={ph: round(1e3 * v, 2) for ph, v in split.items()},
        ddp_backend=args.ddp_backend,
        checkpoint_activations=bool(args.checkpoint_activations),
        compile=bool(args.compile),
        fp8=args.fp8_recipe if args.fp8 else None,
        fp8_experts=ours.fp8_experts,
        peak_gpu_gib=peak_gib,
        peak_gpu_reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None,
        loadavg_before=load_before[0],
        loadavg_after=load_after[0],
        other_cpus_busy=others,
        machine_busy=busy,
    )


if __name__ == "__main__":
    main()
