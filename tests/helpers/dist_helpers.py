"""Helpers for tests/integration/test_distributed.py: a tiny data-bin, CLI runs as subprocesses, and worker programs.

Worker programs (run as ``python -m tests.helpers.dist_helpers COMMAND ...``):

``strategies DATA OUT_JSON``
    two ranks (spawned by toolkit's launcher) train a few updates under every
    ``--ddp-backend`` / ``--sharding-strategy`` / memory option and rank 0 writes the
    full-precision losses, the per-rank parameter bytes and the placements, plus the
    losses of one plain process over the same global batches, to OUT_JSON.

``memcap NPROCS HEADROOM_MB -- TRAIN_ARGS...``
    runs toolkit-train with NPROCS processes, each capping its own address space
    (RLIMIT_AS) at its size just before the model is built plus HEADROOM_MB.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import sys
from typing import Dict, List

from tests.helpers import REPO_ROOT, free_port  # noqa: F401  (tests use H.free_port)
from tests.helpers.cli import run_cli, run_train, subprocess_env  # noqa: F401  (tests use them as H.*)

WORDS = [f"w{i}" for i in range(120)]


def one_rank_cpu_mesh(store_dir: str):
    """A 1-rank gloo process group (unless one exists) and its CPU mesh, for in-process DTensor tests; a
    generator for a module fixture: it destroys the group it created."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{store_dir}/store")
    yield init_device_mesh("cpu", (1,))
    if created:
        dist.destroy_process_group()


def make_lm_data_bin(dest: str) -> str:
    """A deterministic data-bin: 400 training lines (about 230 samples of 32 tokens), 40 valid lines."""
    from tests.helpers.lm_fixtures import make_data_bin

    rng = random.Random(0)
    lines = lambda n: [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(n)]  # noqa: E731
    make_data_bin(dest, {"train": lines(400), "valid": lines(40)})
    return dest


def model_args(save_dir: str) -> List[str]:
    return [
        "--task",
        "language_modeling",
        "--arch",
        "transformer_lm",
        "--decoder-layers",
        "2",
        "--decoder-embed-dim",
        "32",
        "--decoder-ffn-embed-dim",
        "64",
        "--decoder-attention-heads",
        "2",
        "--decoder-input-dim",
        "32",
        "--decoder-output-dim",
        "32",
        "--decoder-normalize-before",
        "--dropout",
        "0",
        "--optimizer",
        "adam",
        "--lr",
        "0.003",
        "--batch-size",
        "4",
        "--tokens-per-sample",
        "32",
        "--seed",
        "3",
        "--num-workers",
        "0",
        "--cpu",
        "--log-format",
        "json",
        "--log-interval",
        "1",
        "--save-dir",
        save_dir,
    ]


def losses(stdout: str, tag: str = "train_inner") -> Dict[int, float]:
    """{update: loss} from ``--log-format json`` lines."""
    out = {}
    for line in stdout.splitlines():
        m = re.search(r"\| " + tag + r" \| (\{.*\})\s*$", line)
        if m:
            stats = json.loads(m.group(1))
            out[int(stats["num_updates"])] = float(stats["loss"])
    return out


REL_TOL = 1e-4
LOGGED_TOL = 1.01e-3  # one unit in the last logged place


def llama_args(save_dir) -> list:
    """``model_args`` for the Llama family (the ``llama_tiny`` architecture)."""
    return [
        "--task",
        "language_modeling",
        "--arch",
        "llama_tiny",
        "--optimizer",
        "adam",
        "--lr",
        "0.003",
        "--batch-size",
        "4",
        "--tokens-per-sample",
        "32",
        "--seed",
        "3",
        "--num-workers",
        "0",
        "--cpu",
        "--log-format",
        "json",
        "--log-interval",
        "1",
        "--save-dir",
        str(save_dir),
        "--no-epoch-checkpoints",
    ]


def train(data_bin, save_dir, *flags, env=None, timeout=240):
    """toolkit-train on ``model_args`` (dropout 0: runs compare loss for loss); fails the test if it fails."""
    proc = run_train([data_bin] + model_args(str(save_dir)) + list(flags), env=env, timeout=timeout)
    assert proc.returncode == 0, (
        f"toolkit-train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


def assert_logged_losses_match(got, want, updates):
    """Logged losses of two runs agree within float noise plus one unit in the last logged place."""
    assert sorted(got) == list(updates), f"updates logged: {sorted(got)}"
    for u in updates:
        assert abs(got[u] - want[u]) <= REL_TOL * abs(want[u]) + LOGGED_TOL, (u, got[u], want[u])


# --- worker: every strategy ------------------------------------------------------------------

# name -> extra flags (2 ranks; --update-freq as given, the reference uses 2 * update_freq on 1 process)
STRATEGY_CONFIGS = {
    "c10d+ac+offload_act": ["--ddp-backend", "c10d", "--checkpoint-activations", "--offload-activations"],
    "no_c10d": ["--ddp-backend", "no_c10d"],
    "full_shard+ac": ["--ddp-backend", "fully_sharded", "--checkpoint-activations"],
    "full_shard+uf2": ["--ddp-backend", "fully_sharded", "--update-freq", "2"],
    "shard_grad_op": ["--ddp-backend", "fully_sharded", "--sharding-strategy", "shard_grad_op"],
    "no_shard": ["--ddp-backend", "fully_sharded", "--sharding-strategy", "no_shard"],
    "hybrid_shard": [
        "--ddp-backend",
        "fully_sharded",
        "--sharding-strategy",
        "hybrid_shard",
        "--shard-group-size",
        "1",
    ],
    "hybrid_shard_zero2": ["--ddp-backend", "fully_sharded", "--sharding-strategy", "hybrid_shard_zero2"],
    "full_shard+cpu_offload+offload_act+no_reshard": [
        "--ddp-backend",
        "fully_sharded",
        "--cpu-offload",
        "--offload-activations",
        "--no-reshard-after-forward",
        "--optimizer",
        "cpu_adam",
    ],  # --cpu-offload's optimizer; its updates match torch's Adam
    "full_shard+bf16": ["--ddp-backend", "fully_sharded", "--bf16"],
}
STRATEGY_UPDATES = 3


def _parse_train_args(argv: List[str]):
    """toolkit-train's resolved config (toolkit.train.resolve), as the command builds it."""
    from toolkit.train.resolve import parse_train_config

    return parse_train_config(argv)


def _train_updates(cfg, env, updates: int, update_freq: int) -> Dict:
    """Build task/model/trainer as toolkit-train does and run ``updates`` updates; full-precision losses."""
    import torch

    from toolkit.core.dtensor import local_tensor
    from toolkit.logging import metrics
    from toolkit.train.train_loop import build_trainer, train_iterator

    torch.manual_seed(cfg.common.seed)
    trainer = build_trainer(cfg, env, [cfg.dataset.train_subset])
    model, strategy = trainer.model, trainer.strategy
    itr = train_iterator(cfg, trainer, epoch=1).next_epoch_itr(shuffle=True)

    out = {"losses": [], "grad_norms": []}
    for _ in range(updates):
        samples = [next(itr) for _ in range(update_freq)]
        with metrics.aggregate(new_root=True) as agg:
            totals = trainer.train_step(samples)
        out["losses"].append(float(totals["loss"]) / float(totals["sample_size"]) / math.log(2))
        out["grad_norms"].append(float(agg.get_smoothed_values()["gnorm"]))
    params = list({id(p): p for p in model.parameters()}.values())
    out["local_param_numel"] = sum(local_tensor(p).numel() for p in params)
    out["param_numel"] = sum(p.numel() for p in params)
    first = params[1] if len(params) > 1 else params[0]
    out["placements"] = str(getattr(first, "placements", None))
    dims = strategy.dims
    out["mesh"] = list(dims.mesh("dp_replicate", "dp_shard", "cp", "tp").shape) if dims.shape.needs_mesh else None
    out["kind"] = strategy.name
    return out


def _sync_skipped(cfg, env) -> bool:
    """After one micro-batch under ``grad_sync(enabled=False)``, no gradient was communicated:
    DDP/no_c10d gradients still differ between ranks, FSDP2's sharded gradients are not produced yet."""
    import torch
    import torch.distributed as dist

    from toolkit.train.train_loop import build_trainer, train_iterator
    from toolkit.train.trainer import forward_and_loss

    trainer = build_trainer(cfg, env, [cfg.dataset.train_subset])
    model, strategy = trainer.model, trainer.strategy
    sample = next(train_iterator(cfg, trainer, epoch=1).next_epoch_itr(shuffle=True))
    with strategy.grad_sync(model, enabled=False):
        loss, _, _ = forward_and_loss(model, trainer.criterion, sample)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    if strategy.name == "fsdp":
        return all(g is None for g in grads)
    flat = torch.cat([g.flatten() for g in grads])
    gathered = [torch.empty_like(flat) for _ in range(env.world_size)]
    dist.all_gather(gathered, flat)
    return not torch.allclose(gathered[0], gathered[1])


def strategies_worker(cfg) -> None:
    """``main`` of each spawned rank: every config in turn on the same process group."""
    import torch.distributed as dist

    from toolkit.distributed.utils import init_distributed
    from toolkit.logging.setup import setup_logging

    env = init_distributed(cfg.distributed, cpu=cfg.common.cpu)
    setup_logging(None, rank=env.rank)
    results = {}
    base_argv = json.loads(os.environ["TOOLKIT_TEST_BASE_ARGV"])
    for name, flags in STRATEGY_CONFIGS.items():
        a = _parse_train_args(base_argv + flags)
        results[name] = _train_updates(a, env, STRATEGY_UPDATES, a.optimization.update_freq)
        dist.barrier()
    for backend in ("c10d", "no_c10d", "fully_sharded"):
        a = _parse_train_args(base_argv + ["--ddp-backend", backend])
        results.setdefault("_sync_skipped", {})[backend] = _sync_skipped(a, env)
        dist.barrier()
    if env.rank == 0:
        # The same global batches on one plain process (no collectives): update_freq * world size batches each.
        from toolkit.distributed.utils import DistributedEnv

        single = DistributedEnv(rank=0, world_size=1, device=env.device)
        refs = {}
        for uf in sorted(
            {_parse_train_args(base_argv + f).optimization.update_freq for f in STRATEGY_CONFIGS.values()}
        ):
            a = _parse_train_args(base_argv + ["--ddp-backend", "c10d", "--update-freq", str(uf * env.world_size)])
            refs[uf] = _train_updates(a, single, STRATEGY_UPDATES, uf * env.world_size)
        for name, flags in STRATEGY_CONFIGS.items():
            results[name]["reference"] = refs[_parse_train_args(base_argv + flags).optimization.update_freq]
        with open(os.environ["TOOLKIT_TEST_OUT"], "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()


def strategies_main(data: str, out: str) -> None:
    from toolkit.distributed import launch

    cfg = _parse_train_args([data] + model_args(os.path.dirname(out)) + ["--distributed-world-size", "2"])
    os.environ["TOOLKIT_TEST_BASE_ARGV"] = json.dumps([data] + model_args(os.path.dirname(out)))
    os.environ["TOOLKIT_TEST_OUT"] = out
    launch.run(strategies_worker, cfg)


# --- worker: a capped address space ------------------------------------------------------------


def vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def capped_main(cfg) -> None:
    """toolkit-train's loop, with RLIMIT_AS set to (size now + headroom) just before the model is built."""
    import resource

    import toolkit.train.train_loop as train

    headroom = int(os.environ["TOOLKIT_TEST_HEADROOM_MB"]) << 20
    build = train.build_parallel_model

    def build_capped(a, task, env):
        base = vm_bytes()
        cap = base + headroom
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        print(
            f"rank {env.rank}: address space capped at {cap >> 20} MiB "
            f"({base >> 20} MiB before the model + {headroom >> 20} MiB)",
            flush=True,
        )
        return build(a, task, env)

    train.build_parallel_model = build_capped
    train.train(cfg)
    print(f"rank {int(os.environ.get('RANK', 0))}: finished under the cap, peak VM {_peak_vm() >> 20} MiB", flush=True)


def _peak_vm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmPeak:"):
                return int(line.split()[1]) * 1024
    return 0


def memcap_main(nprocs: int, headroom_mb: int, train_argv: List[str]) -> None:
    from toolkit.distributed import launch
    from toolkit.core.errors import UserError

    os.environ["TOOLKIT_TEST_HEADROOM_MB"] = str(headroom_mb)
    try:
        cfg = _parse_train_args(train_argv + ["--distributed-world-size", str(nprocs)])
        launch.run(capped_main, cfg)
    except UserError as e:
        print(f"toolkit-train: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "strategies":
        strategies_main(sys.argv[2], sys.argv[3])
    elif command == "memcap":
        sep = sys.argv.index("--")
        memcap_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[sep + 1 :])
    else:
        raise SystemExit(f"unknown command {command}")
