"""Run state as Statefuls, for tests/unit/test_statefuls.py and tests/integration/test_statefuls_ranks.py: a
piece of state the checkpoint formats have never seen, a trainer built as toolkit-train builds it, its save and
resume with entries added to ``Trainer.statefuls``, and the worker of 2 FSDP2 ranks saving such a checkpoint
(``python -m tests.helpers.statefuls DATA SAVE_DIR OUT``).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict

import torch

from tests.helpers import dist_helpers as H


class Counter:
    """A piece of run state the formats have never seen: a plain Stateful."""

    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self) -> Dict[str, Any]:
        return {"value": self.value, "history": torch.arange(self.value)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.value = state["value"]
        assert torch.equal(state["history"], torch.arange(self.value))


def run(data_bin: str, save_dir: str, *flags: str):
    """A trainer and the loop's progress, as toolkit-train builds them (one process)."""
    from toolkit.checkpoint.common import BestTracker, TrainingState
    from toolkit.distributed.utils import DistributedEnv
    from toolkit.train.train_loop import build_trainer, train_iterator

    cfg = H._parse_train_args([data_bin] + H.model_args(save_dir) + list(flags))
    torch.manual_seed(cfg.common.seed)
    trainer = build_trainer(cfg, DistributedEnv(), [cfg.dataset.train_subset])
    state = TrainingState(trainer, BestTracker(False))
    state.epoch_itr = train_iterator(cfg, trainer, epoch=1)
    return cfg, trainer, state


def train_and_save(data_bin: str, save_dir: str, *flags: str, updates: int = 2, extra=None):
    """``updates`` updates, then the loop's save (``extra``: entries added to the trainer's mapping)."""
    from toolkit.distributed.utils import DistributedEnv
    from toolkit.train import checkpoint_manager as manager

    cfg, trainer, state = run(data_bin, save_dir, *flags)
    add_entries(trainer, extra or {})
    batches = state.epoch_itr.next_epoch_itr(shuffle=True)
    for _ in range(updates):
        trainer.train_step([next(batches)])
    state.val_loss = 4.25
    manager.save_checkpoint(cfg, trainer, state, False, DistributedEnv())
    return cfg, trainer, state


def add_entries(trainer, extra: Dict[str, Any]) -> None:
    """What adding a piece of run state takes: one more entry in the trainer's mapping."""
    statefuls = trainer.statefuls
    trainer.statefuls = lambda progress: {**statefuls(progress), **extra}


def resume(data_bin: str, save_dir: str, *flags: str, extra=None):
    from toolkit.distributed.utils import DistributedEnv
    from toolkit.train import checkpoint_manager as manager

    cfg, trainer, state = run(data_bin, save_dir, *flags)
    add_entries(trainer, extra or {})
    position = manager.load_latest(cfg, trainer, state, DistributedEnv())
    return trainer, state, position


def full_state(trainer) -> Dict[str, Any]:
    from toolkit.checkpoint.consolidated import model_state, optimizer_state

    return {
        "model": model_state(trainer.model),
        "optim": optimizer_state(trainer.model, trainer.optimizer)["state"],
        "trainer": trainer.state_dict(),
    }


def assert_same(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    else:
        assert a == b, path


# --- 2 FSDP2 ranks ---------------------------------------------------------------------------------

RANK_FLAGS = ["--distributed-world-size", "2", "--ddp-backend", "fully_sharded", "--use-sharded-state"]


def probe_module() -> torch.nn.Module:
    """A tensor entry the formats have never seen, the same on every rank."""
    torch.manual_seed(11)
    return torch.nn.Linear(3, 4)


def ranks_worker(cfg) -> None:
    """Each rank: 2 updates, then the loop's sharded save with a Counter and a probe module added; rank 0 writes
    the gathered model and the probe's weights to $TOOLKIT_TEST_OUT."""
    from toolkit.checkpoint.common import BestTracker, TrainingState
    from toolkit.checkpoint.consolidated import model_state
    from toolkit.checkpoint.stateful import ModelState
    from toolkit.distributed.utils import init_distributed
    from toolkit.train import checkpoint_manager as manager
    from toolkit.train.train_loop import build_trainer, train_iterator

    env = init_distributed(cfg.distributed, cpu=cfg.common.cpu)
    torch.manual_seed(cfg.common.seed)
    trainer = build_trainer(cfg, env, [cfg.dataset.train_subset])
    state = TrainingState(trainer, BestTracker(False))
    state.epoch_itr = train_iterator(cfg, trainer, epoch=1)
    probe = probe_module()
    add_entries(trainer, {"counter": Counter(5 + env.rank), "probe": ModelState(probe)})
    batches = state.epoch_itr.next_epoch_itr(shuffle=True)
    for _ in range(2):
        trainer.train_step([next(batches)])
    manager.save_checkpoint(cfg, trainer, state, False, env)
    full = model_state(trainer.model)  # collective: every rank gathers, rank 0 keeps it
    if env.rank == 0:
        torch.save(
            {"model": full, "probe": probe.state_dict(), "num_updates": trainer.num_updates},
            os.environ["TOOLKIT_TEST_OUT"],
        )


def ranks_main(data: str, save_dir: str, out: str) -> None:
    from toolkit.distributed import launch

    os.environ["TOOLKIT_TEST_OUT"] = out
    launch.run(ranks_worker, H._parse_train_args([data] + H.model_args(save_dir) + RANK_FLAGS))


if __name__ == "__main__":
    ranks_main(*sys.argv[1:4])
