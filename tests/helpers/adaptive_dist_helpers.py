"""Worker for tests/integration/test_adaptive_distributed.py
(``python -m tests.helpers.adaptive_dist_helpers DATA OUT_JSON``).

Two ranks (spawned by toolkit's launcher) train a tiny adaptive model (adaptive input and softmax,
tied weights and projections, as transformer_lm_wiki103) for a few updates under each parallel
setup, reusing tests/helpers/dist_helpers.py's trainer driver; rank 0 adds the losses of one plain process
over the same global batches and writes everything to OUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys

from tests.helpers import dist_helpers as H

ADAPTIVE = [
    "--arch",
    "transformer_lm_wiki103",
    "--adaptive-input-cutoff",
    "20,60",
    "--adaptive-softmax-cutoff",
    "20,60",
    "--adaptive-softmax-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--activation-dropout",
    "0",
]
UPDATES = 3

# name -> extra flags; the ones with a reference are compared with one process at --update-freq 2
CONFIGS = {
    "c10d": ["--ddp-backend", "c10d"],
    "full_shard+ac": ["--ddp-backend", "fully_sharded", "--checkpoint-activations"],
    "full_shard+bf16": ["--ddp-backend", "fully_sharded", "--bf16"],
    "full_shard+fp16": ["--ddp-backend", "fully_sharded", "--fp16"],
    # LayerDrop: every rank skips the same layers, whatever the backend (SGD: an unused parameter's
    # gradient, None under FSDP2 and zero under no_c10d, takes the same step)
    "layerdrop:full_shard": [
        "--ddp-backend",
        "fully_sharded",
        "--decoder-layerdrop",
        "0.5",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--decoder-layers",
        "4",
    ],
    "layerdrop:no_c10d": [
        "--ddp-backend",
        "no_c10d",
        "--decoder-layerdrop",
        "0.5",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--decoder-layers",
        "4",
    ],
}


def base_argv(data: str, save_dir: str) -> list:
    return [data] + H.model_args(save_dir) + ADAPTIVE + ["--criterion", "adaptive_loss"]


def worker(cfg) -> None:
    import torch.distributed as dist

    from toolkit.distributed.utils import DistributedEnv, init_distributed
    from toolkit.logging.setup import setup_logging

    env = init_distributed(cfg.distributed, cpu=cfg.common.cpu)
    setup_logging(None, rank=env.rank)
    base = json.loads(os.environ["TOOLKIT_TEST_BASE_ARGV"])
    results = {}
    for name, flags in CONFIGS.items():
        results[name] = H._train_updates(H._parse_train_args(base + flags), env, UPDATES, 1)
        dist.barrier()
    if env.rank == 0:
        single = DistributedEnv(rank=0, world_size=1, device=env.device)
        a = H._parse_train_args(base + ["--update-freq", str(env.world_size)])
        results["reference"] = H._train_updates(a, single, UPDATES, env.world_size)
        with open(os.environ["TOOLKIT_TEST_OUT"], "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()


def main(data: str, out: str) -> None:
    from toolkit.distributed import launch

    argv = base_argv(data, os.path.dirname(out))
    os.environ["TOOLKIT_TEST_BASE_ARGV"], os.environ["TOOLKIT_TEST_OUT"] = json.dumps(argv), out
    launch.run(worker, H._parse_train_args(argv + ["--distributed-world-size", "2"]))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
