"""Worker for tests/integration/test_compile.py: eager and ``--compile`` runs of the same flags, in one launched group.

    python -m tests.helpers.compile_helpers DATA OUT_JSON WORLD_SIZE CONFIGS_JSON [llama]

CONFIGS_JSON is a list of ``[name, flags, backend]``; ``backend`` (or null) is put in
``TOOLKIT_COMPILE_BACKEND`` for that config; ``llama``: the flags go on ``llama_args`` instead of
``model_args``. Every rank builds each config as toolkit-train
does (``build_trainer``), runs ``UPDATES`` updates on the same batches, and rank 0 writes, per
config: the full-precision losses, the model's state-dict keys, and how many graphs dynamo
captured in all (a compiled config that captured none would be an eager run in disguise) and
after each update (a count still growing after the first update means recompiling).
Dynamo's caches are reset between configs, so each one compiles on its own.
"""

from __future__ import annotations

import json
import os
import sys

from tests.helpers.dist_helpers import _parse_train_args, llama_args, model_args

UPDATES = 3


def _captured_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _train_updates(cfg, env) -> dict:
    """``UPDATES`` updates as toolkit-train runs them: full-precision losses and the model's state-dict keys."""
    import math

    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from toolkit.logging import metrics
    from toolkit.train.train_loop import build_trainer, train_iterator

    torch.manual_seed(cfg.common.seed)
    trainer = build_trainer(cfg, env, [cfg.dataset.train_subset])
    itr = train_iterator(cfg, trainer, epoch=1).next_epoch_itr(shuffle=True)
    losses, graphs = [], []
    for _ in range(UPDATES):
        with metrics.aggregate(new_root=True):
            totals = trainer.train_step([next(itr)])
        losses.append(float(totals["loss"]) / float(totals["sample_size"]) / math.log(2))
        graphs.append(_captured_graphs())
    return {"losses": losses, "keys": sorted(get_model_state_dict(trainer.model).keys()), "graphs_after": graphs}


def worker(cfg) -> None:
    import torch._dynamo
    import torch.distributed as dist

    from toolkit.distributed.compile import BACKEND_ENV
    from toolkit.distributed.utils import init_distributed
    from toolkit.logging.setup import setup_logging

    env = init_distributed(cfg.distributed, cpu=cfg.common.cpu)
    setup_logging(None, rank=env.rank)
    base_argv = json.loads(os.environ["TOOLKIT_TEST_BASE_ARGV"])
    results = {}
    for name, flags, backend in json.loads(os.environ["TOOLKIT_TEST_CONFIGS"]):
        os.environ.pop(BACKEND_ENV, None)
        if backend:
            os.environ[BACKEND_ENV] = backend
        torch._dynamo.reset()
        before = _captured_graphs()
        out = _train_updates(_parse_train_args(base_argv + flags), env)
        out["graphs"] = _captured_graphs() - before
        out["graphs_after"] = [count - before for count in out["graphs_after"]]
        results[name] = out
        if dist.is_initialized():
            dist.barrier()
    if env.rank == 0:
        with open(os.environ["TOOLKIT_TEST_OUT"], "w") as f:
            json.dump(results, f, indent=1)


def main(data: str, out: str, world_size: int, configs: str, family: str = "transformer_lm") -> None:
    from toolkit.distributed import launch

    family_args = llama_args if family == "llama" else model_args
    base = [data] + family_args(os.path.dirname(out)) + ["--disable-validation"]
    cfg = _parse_train_args(base + ["--distributed-world-size", str(world_size)])
    os.environ["TOOLKIT_TEST_BASE_ARGV"] = json.dumps(base)
    os.environ["TOOLKIT_TEST_OUT"] = out
    os.environ["TOOLKIT_TEST_CONFIGS"] = configs
    launch.run(worker, cfg)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], *sys.argv[5:6])
