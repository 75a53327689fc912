"""Per-rank training state and throughput: 1 process vs 2 ranks (DDP, FSDP2) on CPU.

    python -m benchmarks.distributed                 # 4 layers x 256, 60 timed updates
    python -m benchmarks.distributed --layers 8 --dim 512 --updates 20 --json out.json

For each setting, every rank reports the bytes of the tensors it holds for training
(its parameters' local shards, their gradients, the optimizer's state tensors), counted
right after ``optimizer.step()`` and before ``zero_grad`` (when all three exist: their
peak), its peak RSS, and the tokens/s of the whole run over the timed updates.

Checks that FSDP2 (full_shard) on 2 ranks holds at most 55% of the one-process state per rank.
On a machine with few cores, ranks share them: tokens/s then measures overhead, not scaling.
Prints a table and one JSON line (``"benchmark": "distributed_state"``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
from typing import Dict, List

import numpy as np
import torch

from benchmarks.timing import Report, Stats, add_results_flag, time_call

SETTINGS = [  # (name, world size, flags)
    ("1 process", 1, ["--ddp-backend", "c10d"]),
    ("c10d (DDP) x2", 2, ["--ddp-backend", "c10d"]),
    ("fully_sharded x2", 2, ["--ddp-backend", "fully_sharded"]),
    ("fully_sharded x2 +ac", 2, ["--ddp-backend", "fully_sharded", "--checkpoint-activations"]),
]


def make_data_bin(dest: str, vocab: int = 500, tokens: int = 400_000, seed: int = 0) -> str:
    """A synthetic data-bin (Zipf-distributed tokens) written with the toolkit's own Dictionary and builder."""
    from toolkit.data.dictionary import Dictionary
    from toolkit.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype

    os.makedirs(dest, exist_ok=True)
    d = Dictionary()
    for i in range(vocab):
        d.add_symbol(f"w{i}")
    d.save(os.path.join(dest, "dict.txt"))
    rng = np.random.default_rng(seed)
    for split, n in (("train", tokens), ("valid", tokens // 20)):
        ids = (rng.zipf(1.2, size=n) % vocab + d.nspecial).astype(np.int64)
        lengths = rng.integers(8, 64, size=n // 30)
        lengths = lengths[np.cumsum(lengths) <= n]
        items, start = [], 0
        for length in lengths:
            items.append(np.append(ids[start : start + length - 1], d.eos()))
            start += length
        builder = MMapIndexedDatasetBuilder(os.path.join(dest, split + ".bin"), dtype=best_fitting_dtype(len(d)))
        builder.add_items(np.concatenate(items), np.array([len(x) for x in items]))
        builder.finalize(os.path.join(dest, split + ".idx"))
    return dest


def local_bytes(t: torch.Tensor) -> int:
    from toolkit.core.dtensor import local_tensor

    t = local_tensor(t)
    return t.numel() * t.element_size()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, int]:
    params = list({id(p): p for p in model.parameters()}.values())
    out = {
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            local_bytes(v) for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)
        ),
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def worker(cfg) -> None:
    """``main`` of every rank (spawned by toolkit's launcher, or run directly for one process)."""
    import torch.distributed as dist

    from toolkit.distributed.utils import init_distributed
    from toolkit.logging.setup import setup_logging
    from toolkit.train.train_loop import build_trainer, train_iterator

    env = init_distributed(cfg.distributed, cpu=cfg.common.cpu)
    setup_logging(None, rank=env.rank)
    import logging

    logging.getLogger().setLevel(logging.WARNING)
    torch.manual_seed(cfg.common.seed)
    trainer = build_trainer(cfg, env, [cfg.dataset.train_subset])
    model = trainer.model
    peak: Dict[str, int] = {"total": 0}

    def after_step(opt, *_):
        counted = state_bytes(model, opt)
        if counted["total"] > peak["total"]:
            peak.update(counted)

    trainer.optimizer.register_step_post_hook(after_step)
    itr = train_iterator(cfg, trainer, epoch=1)
    batches = itr.next_epoch_itr(shuffle=True)
    warmup, timed = 3, int(os.environ["TOOLKIT_BENCH_UPDATES"])

    def updates(n: int) -> float:
        nonlocal batches
        tokens = 0.0
        for _ in range(n):
            if not batches.has_next():
                batches = train_iterator(cfg, trainer, epoch=itr.epoch + 1).next_epoch_itr(shuffle=True)
            tokens += trainer.train_step([next(batches)])["ntokens"]  # summed over ranks
        return tokens

    updates(warmup)
    elapsed, tokens = time_call(lambda: updates(timed))
    result = {
        "rank": env.rank,
        "state": dict(peak),
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    results: List[dict] = [result]
    if dist.is_initialized() and dist.get_world_size() > 1:
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
    if env.rank == 0:
        with open(os.environ["TOOLKIT_BENCH_OUT"], "w") as f:
            json.dump(results, f)


def run_setting(data: str, world_size: int, flags: List[str], cli: argparse.Namespace, out: str) -> List[dict]:
    from toolkit.distributed import launch
    from toolkit.train.resolve import parse_train_config

    argv = [
        data,
        "--task",
        "language_modeling",
        "--arch",
        "transformer_lm",
        "--decoder-layers",
        str(cli.layers),
        "--decoder-embed-dim",
        str(cli.dim),
        "--decoder-ffn-embed-dim",
        str(4 * cli.dim),
        "--decoder-attention-heads",
        str(max(cli.dim // 64, 1)),
        "--decoder-input-dim",
        str(cli.dim),
        "--decoder-output-dim",
        str(cli.dim),
        "--decoder-normalize-before",
        "--dropout",
        "0",
        "--optimizer",
        "adam",
        "--lr",
        "0.0005",
        "--tokens-per-sample",
        str(cli.seq),
        "--batch-size",
        str(cli.batch),
        "--num-workers",
        "0",
        "--cpu",
        "--no-save",
        "--disable-validation",
        "--log-format",
        "none",
        "--distributed-world-size",
        str(world_size),
        *flags,
    ]
    os.environ["TOOLKIT_BENCH_OUT"], os.environ["TOOLKIT_BENCH_UPDATES"] = out, str(cli.updates)
    launch.run(worker, parse_train_config(argv))
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per update")
    p.add_argument("--updates", type=int, default=60, help="timed updates (after 3 warm-up updates)")
    p.add_argument("--data", default=None, help="a data-bin (default: a synthetic one in a temp folder)")
    p.add_argument("--json", default=None, help="also write the figures here")
    add_results_flag(p)
    cli = p.parse_args(argv)
    report = Report("distributed_state", argv=argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from toolkit.core import registry

    registry.import_all_components()
    with tempfile.TemporaryDirectory() as tmp:
        data = cli.data or make_data_bin(os.path.join(tmp, "bin"))
        rows = []
        for name, ws, flags in SETTINGS:
            results = run_setting(data, ws, flags, cli, os.path.join(tmp, "result.json"))
            rows.append((name, ws, results))
    base = rows[0][2][0]["state"]["total"]
    mib = 1 << 20
    print(
        f"\nmodel: {cli.layers} layers x {cli.dim}, seq {cli.seq}, batch {cli.batch}/rank; "
        f"CPU, {os.cpu_count()} cores shared by all ranks, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    )
    print(
        f"{'setting':24} {'params':>9} {'grads':>9} {'optim':>9} {'state/rank':>11} {'vs 1 proc':>9} "
        f"{'max RSS':>9} {'tokens/s':>10}"
    )
    summary, stats = [], {}
    for name, ws, results in rows:
        stats[name] = Stats([results[0]["seconds"]])
        r = max(results, key=lambda x: x["state"]["total"])  # the rank holding the most
        st = r["state"]
        ratio = st["total"] / base
        print(
            f"{name:24} {st['params'] / mib:8.1f}M {st['grads'] / mib:8.1f}M {st['optimizer'] / mib:8.1f}M "
            f"{st['total'] / mib:10.1f}M {ratio:8.0%} {r['max_rss'] / mib:8.0f}M {results[0]['tokens_per_s']:10.0f}"
        )
        summary.append(
            {
                "setting": name,
                "world_size": ws,
                "state_bytes_per_rank": st,
                "ratio_to_1proc": ratio,
                "max_rss": r["max_rss"],
                "tokens_per_s": results[0]["tokens_per_s"],
            }
        )
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump(summary, f, indent=1)
    fsdp = next(s for s in summary if s["setting"] == "fully_sharded x2")
    ok = fsdp["ratio_to_1proc"] <= 0.55
    report.emit(stats, "1 process", cli.results, updates=cli.updates, rows=summary, fsdp_within_55_percent=ok)
    print(
        f"\nfully_sharded x2 per-rank state = {fsdp['ratio_to_1proc']:.1%} of one process "
        f"({'OK' if ok else 'FAIL'}: must be <= 55%)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
