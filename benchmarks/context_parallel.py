"""Context parallelism on CPU ranks: one training step of a long sequence split over 2 gloo ranks vs one process.

    python -m benchmarks.context_parallel                       # T 8192 and 16384, CP 1 and CP 2
    python -m benchmarks.context_parallel --tokens 8192 --layers 1 --dim 128 --heads 2 --kv-heads 1

Each configuration runs in fresh processes (spawned; CP 2 is two gloo ranks on this machine): a Llama block
stack (``LlamaLanguageModel``, fp32, the given width), one sequence of ``--tokens`` tokens, forward and
backward of the summed cross-entropy. CP 1 is the plain model (SDPA ``is_causal``); CP 2 goes through the
toolkit's path (``context_parallel.shard_sample``: the rank's two chunks, global positions, K/V all-gathered
with the mask of the layout). Reported per rank: the step's time (median of ``--steps`` after one warm-up
step) and the peak resident memory the steps added over the process's memory before them (``ru_maxrss``, the
high-water mark of the process: activations, the attention's scores and mask, gradients). Both ranks of CP 2
share the machine's cores with each other, so their time is not a speed-up measurement on 2 cores; the
memory per rank is the figure of interest (one GPU or one host per rank is where CP saves time).
Prints a line per configuration and rank, then one JSON line (``"benchmark": "context_parallel"``).
"""

from __future__ import annotations

import argparse
import os
import resource

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.timing import Report, Stats, add_results_flag, repeat


def _model(args):
    from toolkit.models.llama.config import LlamaConfig
    from toolkit.models.llama.model import LlamaLanguageModel

    cfg = LlamaConfig(
        decoder_layers=args.layers,
        decoder_embed_dim=args.dim,
        decoder_ffn_embed_dim=2 * args.dim,
        decoder_attention_heads=args.heads,
        decoder_kv_heads=args.kv_heads,
        max_target_positions=args.tokens,
    )
    return LlamaLanguageModel(cfg, vocab_size=args.vocab, padding_idx=1, seed=0)


def _step(model, sample, pad: int) -> None:
    net = sample["net_input"]
    kwargs = {k: net[k] for k in ("positions", "context_parallel") if k in net}
    logits = model(net["src_tokens"], **kwargs)
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), sample["target"].flatten(), ignore_index=pad, reduction="sum"
    )
    loss.backward()
    model.zero_grad(set_to_none=True)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker(rank: int, world: int, port: int, args, results) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    from toolkit.distributed.context_parallel import shard_sample

    torch.manual_seed(0)
    model = _model(args)
    tokens = torch.randint(4, args.vocab, (1, args.tokens + 1))
    sample = {"net_input": {"src_tokens": tokens[:, :-1]}, "target": tokens[:, 1:], "ntokens": args.tokens}
    if world > 1:
        sample = shard_sample(sample, world, rank, dist.group.WORLD, pad=1)
    before = _rss_mib()  # the model and the batch; the step's activations come on top

    def step():
        if world > 1:
            dist.barrier()  # the ranks start each step together
        _step(model, sample, 1)

    stats = repeat(step, args.steps, warmup=1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    results[rank] = dict(seconds=stats.seconds, peak_added_mib=peak - before, rss_before_mib=before)
    if world > 1:
        dist.destroy_process_group()


def run(args, world: int) -> dict:
    from tests.helpers import free_port

    results = mp.Manager().dict()
    mp.start_processes(_worker, args=(world, free_port(), args, results), nprocs=world, start_method="spawn")
    return dict(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    add_results_flag(parser)
    args = parser.parse_args()
    report = Report("context_parallel")
    stats, rows = {}, []
    for tokens in list(args.tokens):
        for world in (1, 2):
            args.tokens = tokens
            per_rank = run(args, world)
            for rank, r in sorted(per_rank.items()):
                stats[f"T {tokens} CP {world} rank {rank}"] = st = Stats(r["seconds"])
                rows.append(
                    dict(
                        tokens=tokens,
                        cp=world,
                        rank=rank,
                        seconds=round(st.median, 3),
                        peak_added_mib=round(r["peak_added_mib"], 1),
                        rss_before_mib=round(r["rss_before_mib"], 1),
                    )
                )
                print(
                    f"T {tokens} CP {world} rank {rank}: step {st.median:.3f} s (median of {len(st.seconds)}), "
                    f"peak added {r['peak_added_mib']:.1f} MiB over {r['rss_before_mib']:.1f}",
                    flush=True,
                )
    report.emit(stats, results=args.results, rows=rows)


if __name__ == "__main__":
    main()
