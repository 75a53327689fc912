"""Pipeline schedules on 2 gloo CPU ranks against toolkit-plan: step time, each stage's peak of live tensors, bubble.

    python -m benchmarks.pipeline_schedules                         # every schedule, a 4-layer Llama (~1 minute)
    python -m benchmarks.pipeline_schedules --schedules 1f1b,gpipe --json out.json
    python -m benchmarks.pipeline_schedules --larger                # 256 wide, 256-token rows: the bubble shows

Each rank builds the Llama of ``ARGS`` on the meta device, keeps its stages (``toolkit.distributed.pipeline``), runs
one warm-up step (torch's stages allocate their receive buffers), drops the gradients, then one step under
``toolkit.plan.measure.LivePeak`` (every allocation and free of torch's allocator: the CPU counterpart of
``torch.cuda.max_memory_allocated``), then ``STEPS`` timed steps. A stage's measured memory is its parameters
plus that peak (the gradients, the activations of the micro-batches in flight, the transients); the planner's is
the same rows of its pp rank (``toolkit.plan.pipeline``: parameters, gradients, saved activations, the backward
transient). The measured bubble is ``1 - t1 / (P x tP)``, t1 the same batch's step in one process (its compute
spread over P ranks with nothing waiting), against the planner's ``bubble_fraction``; on a busy 2-core machine
the times are rough.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, List, Sequence

from benchmarks.timing import now

ARGS = [
    "--arch", "llama", "--decoder-layers", "4", "--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "128",
    "--decoder-attention-heads", "4", "--tokens-per-sample", "128", "--batch-size", "8",
    "--distributed-world-size", "2", "--pipeline-parallel-size", "2",
]  # fmt: skip
VOCAB = 512
STEPS = 3
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "dualpipev")
PLANNED_ROWS = ("parameters (fp32 master)", "gradients", "activations (saved)", "backward transient")


def config(schedule: str, args: Sequence[str] = ARGS) -> Any:
    from toolkit.train.arguments import parse_train_args
    from toolkit.train.resolve import resolve

    parsed, explicit = parse_train_args(list(args) + ["--pipeline-schedule", schedule], "pipeline_schedules")
    return resolve(parsed, explicit)[0]


def planned(schedule: str, args: Sequence[str] = ARGS) -> Dict[str, Any]:
    """The planner's per-stage bytes (the rows a stage's live tensors hold) and bubble for ``schedule``."""
    from toolkit.plan.hardware import PRESETS
    from toolkit.plan.pipeline import bubble_fraction, microbatches
    from toolkit.plan.planner import make_plan

    plan = make_plan(config(schedule, args), PRESETS["cpu"], vocab_size=VOCAB)
    stages = [sum(i.host for i in r.items if i.name in PLANNED_ROWS) for r in plan.stage_ranks]
    s = plan.setup
    return {"stages": stages, "bubble": bubble_fraction(s.pp_schedule, s.pp, microbatches(s))}


def _model(cfg: Any) -> Any:
    from toolkit.plan.model_stats import _build

    return _build(cfg.components.arch, cfg.model, VOCAB, cfg.task.tokens_per_sample)


def _batch(cfg: Any) -> Any:
    import torch

    rows, T = cfg.dataset.batch_size, cfg.task.tokens_per_sample
    tokens = torch.randint(2, VOCAB, (rows, T), generator=torch.Generator().manual_seed(0))
    return tokens, torch.roll(tokens, -1, dims=1)


def _loss(logits: Any, target: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), reduction="sum")


def measure_rank(
    rank: int, world: int, schedules: Sequence[str], args: Sequence[str] = ARGS, steps: int = STEPS
) -> List[Dict[str, Any]]:
    """On each of ``world`` gloo ranks (the process group made): every schedule's parameters, live peak and the
    time of a step (over ``steps`` steps; 0: not timed)."""

    from toolkit.distributed.parallel_dims import ParallelDims, parallel_shape
    from toolkit.distributed.pipeline import Pipeline, build_pipeline
    from toolkit.models.init import init_weights
    from toolkit.plan.measure import LivePeak

    dims = ParallelDims(parallel_shape(world, pp=world), rank)
    dims.mesh("world")
    out = []
    for schedule in schedules:
        cfg = config(schedule, args)
        model = _model(cfg)
        pipeline = Pipeline(model, build_pipeline(model, cfg.distributed, dims), dims, schedule, 0)
        model.to_empty(device="cpu")
        init_weights(model, 1)
        tokens, target = _batch(cfg)
        pipeline.step(tokens, target, _loss, pad=1)
        model.zero_grad(set_to_none=True)
        with LivePeak() as live:
            pipeline.step(tokens, target, _loss, pad=1)
        model.zero_grad(set_to_none=True)
        start = now()
        for _ in range(steps):
            pipeline.step(tokens, target, _loss, pad=1)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        out.append(
            dict(
                schedule=schedule,
                params=params,
                live_peak=live.peak,
                step_s=(now() - start) / max(1, steps),
            )
        )
    return out


def one_process_step(args: Sequence[str] = ARGS) -> float:
    """The batch's forward and backward in one process (the same model whole), seconds a step."""
    import torch

    from toolkit.models.init import init_weights

    cfg = config("1f1b", args)
    model = _model(cfg)
    model.to_empty(device="cpu")
    init_weights(model, 1)
    tokens, target = _batch(cfg)
    _loss(model(tokens), target).backward()
    start = now()
    for _ in range(STEPS):
        _loss(model(tokens), target).backward()
    del torch
    return (now() - start) / STEPS


def _worker(rank: int, world: int, port: int, schedules: Sequence[str], args: Sequence[str], out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mine = measure_rank(rank, world, schedules, args)
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(everyone, f)
    finally:
        dist.destroy_process_group()


LARGER = {"--decoder-embed-dim": "256", "--decoder-ffn-embed-dim": "768", "--tokens-per-sample": "256"}


def sized(args: Sequence[str], changes: Dict[str, str]) -> List[str]:
    """``args`` with the values of ``changes``' flags replaced."""
    out = list(args)
    for flag, value in changes.items():
        out[out.index(flag) + 1] = value
    return out


def main() -> None:
    import socket
    import tempfile

    import torch
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--json", default="")
    parser.add_argument(
        "--larger", action="store_true", help="a 256-wide model of 256-token rows: compute outweighs the messages"
    )
    ns = parser.parse_args()
    schedules = ns.schedules.split(",")
    args = sized(ARGS, LARGER) if ns.larger else ARGS
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ranks.json")
        mp.spawn(_worker, args=(2, port, schedules, args, out), nprocs=2)
        with open(out) as f:
            ranks = json.load(f)
    torch.set_num_threads(1)
    t1 = one_process_step(args)
    rows = []
    print(
        f"{'schedule':<18}{'stage':>6}{'measured':>12}{'planned':>12}{'ratio':>7}{'step':>10}{'bubble':>8}{'plan':>7}"
    )
    for i, schedule in enumerate(schedules):
        plan = planned(schedule, args)
        step = max(r[i]["step_s"] for r in ranks)
        bubble = 1 - t1 / (len(ranks) * step)
        for stage, r in enumerate(ranks):
            measured = r[i]["params"] + r[i]["live_peak"]
            ratio = plan["stages"][stage] / measured
            rows.append(dict(schedule=schedule, stage=stage, measured=measured, planned=plan["stages"][stage],
                             step_s=step, bubble=bubble, planned_bubble=plan["bubble"]))  # fmt: skip
            print(
                f"{schedule:<18}{stage:>6}{measured / 2**20:>10.2f}Mi{plan['stages'][stage] / 2**20:>10.2f}Mi"
                f"{ratio:>7.2f}{step * 1e3:>8.1f}ms{bubble:>8.1%}{plan['bubble']:>7.1%}"
            )
    print(f"one process: {t1 * 1e3:.1f} ms a step")
    print(json.dumps({"benchmark": "pipeline_schedules", "args": args, "one_process_s": t1, "rows": rows}))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
