"""What a running trainer actually holds, for checking plans against (tests, ``benchmarks/plan_check.py``).

Why here and not in the benchmark: the unit tests and the benchmark must count the same way, and
neither may take library code from ``toolkit_cli``. Two counts:

* :func:`state_bytes`: the bytes of this rank's parameters (local shards of DTensors), their
  gradients and the optimizer's state tensors, taken right after ``optimizer.step()`` (before
  ``zero_grad``, when all three exist).
* :class:`RssPeak` / :func:`rss_growth_of_update`: the resident-set growth of one (second) update,
  what the transient memory of a step costs the process: gradients, activations, backward buffers.
* :class:`SavedActivations`: the unique storages autograd saves for backward during a training step
  (``torch.autograd.graph.saved_tensors_hooks``), parameters and their views excluded, local shards
  of DTensors. Tensors are kept alive while counting, so a storage is never counted twice; use it
  on small models only. Activation checkpointing recomputes under its own hooks, so what is counted
  is what the forward keeps (the planner's "activations (saved)").
"""
from __future__ import annotations

import resource
from typing import Any, Dict, List, Optional

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    from toolkit.core.dtensor import local_tensor

    return local_tensor(t)


def local_nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, int]:
    """This rank's parameter, gradient and optimizer-state bytes (tied parameters once)."""
    params = list({id(p): p for p in model.parameters()}.values())
    return {"params": sum(local_nbytes(p) for p in params),
            "grads": sum(local_nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(local_nbytes(v) for st in optimizer.state.values() for v in st.values()
                             if isinstance(v, torch.Tensor))}


def _is_parameter(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(t, torch.nn.Parameter) or isinstance(base, torch.nn.Parameter)


class SavedActivations:
    """Counts the bytes autograd saves inside the ``with`` block (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._kept: Dict[int, torch.Tensor] = {}
        self._hooks: Optional[Any] = None

    def _param_storages(self) -> set:
        return {_local(p).untyped_storage()._cdata for p in self.model.parameters()}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not _is_parameter(t):
            local = _local(t)
            key = local.untyped_storage()._cdata
            if key not in self._kept and key not in self._param_storages():
                self._kept[key] = local
        return t

    def __enter__(self) -> "SavedActivations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._kept.values())

    def release(self) -> None:
        self._kept.clear()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measure_trainer(trainer: Any, batches: List[Any]) -> Dict[str, int]:
    """One update on ``batches`` (its micro-batches) while counting: state bytes and saved activations."""
    counted: Dict[str, int] = {}

    def after_step(opt: torch.optim.Optimizer, *_: Any) -> None:
        counted.update(state_bytes(trainer.model, opt))

    handle = trainer.optimizer.register_step_post_hook(after_step)
    with SavedActivations(trainer.model) as saved:
        trainer.train_step(batches[:1])
    handle.remove()
    counted["activations"] = saved.nbytes
    saved.release()
    return counted



OUT_ENV = "TOOLKIT_PLAN_MEASURE_OUT"
MODE_ENV = "TOOLKIT_PLAN_MEASURE_MODE"  # "rss": the resident-set growth of the second update instead


def _rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssPeak:
    """The peak of this process's resident set above its value at ``__enter__``, sampled every millisecond
    on a thread (torch's kernels release the GIL). Freed heap is first handed back (``malloc_trim``), so
    the baseline is what is live; run with ``TOOLKIT_KEEP_CPU_MEMORY=0`` so the trainer keeps glibc's
    default of unmapping large blocks."""

    def __enter__(self) -> "RssPeak":
        import ctypes
        import threading

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.base = self.peak = _rss()
        self._stop = threading.Event()

        def sample() -> None:
            while not self._stop.wait(0.001):
                self.peak = max(self.peak, _rss())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def growth(self) -> int:
        return self.peak - self.base


def rss_growth_of_update(trainer: Any, batches: Any) -> Dict[str, int]:
    """One plain update (optimizer state created), then the resident-set growth of the next one."""
    trainer.train_step([next(batches)])
    batch = next(batches)
    with RssPeak() as rss:
        trainer.train_step([batch])
    return {"rss_growth": rss.growth}


def measure_worker(cfg: Any) -> None:
    """Every rank: build the trainer as toolkit-train does, run one update while counting; rank 0 writes
    all ranks' counts (JSON) to the file named by ``$TOOLKIT_PLAN_MEASURE_OUT``."""
    import json
    import logging
    import os

    import torch.distributed as dist

    from toolkit.distributed.utils import init_distributed
    from toolkit.train.train_loop import build_trainer, train_iterator

    env = init_distributed(cfg.distributed, cpu=cfg.common.cpu)
    logging.getLogger().setLevel(logging.WARNING)
    torch.manual_seed(cfg.common.seed)
    trainer = build_trainer(cfg, env, [cfg.dataset.train_subset])
    batches = train_iterator(cfg, trainer, epoch=1).next_epoch_itr(shuffle=False)
    if os.environ.get(MODE_ENV) == "rss":
        mine = rss_growth_of_update(trainer, batches)
    else:
        mine = measure_trainer(trainer, [next(batches)])
    results: List[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, mine)
    if env.rank == 0:
        with open(os.environ[OUT_ENV], "w") as f:
            json.dump(results, f)


def measure_run(cfg: Any, out: str, rss: bool = False) -> List[Dict[str, int]]:
    """Run :func:`measure_worker` on ``cfg``'s world size (spawned gloo processes); every rank's counts.
    ``rss``: the resident-set growth of the second update (:func:`rss_growth_of_update`) instead."""
    import json
    import os

    from toolkit.distributed import launch

    os.environ[OUT_ENV] = out
    os.environ[MODE_ENV] = "rss" if rss else "tensors"
    if rss:
        os.environ["TOOLKIT_KEEP_CPU_MEMORY"] = "0"
    launch.run(measure_worker, cfg)
    with open(out) as f:
        return json.load(f)
