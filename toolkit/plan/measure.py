"""What a running trainer actually holds, for checking plans against (tests, ``benchmarks/plan_check.py``).

Why here and not in the benchmark: the unit tests and the benchmark must count the same way, and
neither may take library code from ``toolkit_cli``. Two counts:

* :func:`state_bytes`: the bytes of this rank's parameters (local shards of DTensors), their
  gradients and the optimizer's state tensors, taken right after ``optimizer.step()`` (before
  ``zero_grad``, when all three exist).
* :class:`RssPeak`: the resident-set growth of an update, reported beside the live peak: what the
  process costs the machine, allocator reuse and fragmentation included.
* :class:`LivePeak` / :func:`live_peak_of_update`: the peak of live tensor bytes above the start of one
  (second) update, from the allocation events of torch's profiler: on CPU the equivalent of
  ``torch.cuda.max_memory_allocated`` minus what was allocated before, i.e. the planner's "update peak".
  Exact (every allocation and free, no sampling, no allocator reuse or fragmentation in it).
* :class:`SavedActivations`: the unique storages autograd saves for backward during a training step
  (``torch.autograd.graph.saved_tensors_hooks``), parameters and their views excluded, local shards
  of DTensors. Tensors are kept alive while counting, so a storage is never counted twice; use it
  on small models only. Activation checkpointing recomputes under its own hooks, so what is counted
  is what the forward keeps (the planner's "activations (saved)").
"""

from __future__ import annotations

import resource
from typing import Any, Dict, Iterator, List, Optional

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
    return {
        "params": sum(local_nbytes(p) for p in params),
        "grads": sum(local_nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            local_nbytes(v) for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)
        ),
    }


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

    def __enter__(self) -> SavedActivations:
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


def measure_trainer(trainer: Any, batches: Iterator[Any], tries: int = 4) -> Dict[str, int]:
    """One update while counting: state bytes and saved activations. Under ``--fp16`` the first updates
    may overflow and skip the step (no optimizer state yet): counted again on the next batch then."""
    counted: Dict[str, int] = {}

    def after_step(opt: torch.optim.Optimizer, *_: Any) -> None:
        counted.update(state_bytes(trainer.model, opt))

    handle = trainer.optimizer.register_step_post_hook(after_step)
    step_optimizer = trainer._step_optimizer

    def grads_before_step(*args: Any, **kwargs: Any) -> Any:
        # --memory-efficient-fp16 hides the fp16 gradients from the optimizer during its step: count them here.
        counted["grads_before_step"] = sum(
            local_nbytes(p.grad) for p in trainer.model.parameters() if p.grad is not None
        )
        return step_optimizer(*args, **kwargs)

    trainer._step_optimizer = grads_before_step
    for _ in range(tries):
        with SavedActivations(trainer.model) as saved:
            trainer.train_step([next(batches)])
        counted["activations"] = saved.nbytes
        saved.release()
        if "params" in counted:
            break
    handle.remove()
    del trainer._step_optimizer  # the instance attribute: the class's method again
    counted["grads"] = max(counted.get("grads", 0), counted.pop("grads_before_step", 0))
    return counted


def _warm_up(trainer: Any, batches: Iterator[Any], tries: int = 4) -> None:
    """Plain updates until the optimizer holds its state (``--fp16``'s first updates may overflow and skip it)."""
    for _ in range(tries):
        trainer.train_step([next(batches)])
        if len(trainer.optimizer.state):
            return


OUT_ENV = "TOOLKIT_PLAN_MEASURE_OUT"
MODE_ENV = "TOOLKIT_PLAN_MEASURE_MODE"  # "peak": an update's live-tensor peak and RSS growth instead


def _rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssPeak:
    """The peak of this process's resident set above its value at ``__enter__``, sampled every millisecond
    on a thread (torch's kernels release the GIL). Freed heap is first handed back (``malloc_trim``), so
    the baseline is what is live; run with ``TOOLKIT_KEEP_CPU_MEMORY=0`` so the trainer keeps glibc's
    default of unmapping large blocks."""

    def __enter__(self) -> RssPeak:
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


class LivePeak:
    """The peak of live tensor bytes inside the ``with`` block, above their level at ``__enter__``.

    Why the profiler: CPU torch has no allocator statistics, and RSS moves with glibc's reuse of freed
    blocks (it read 324 MiB for an update whose tensors never exceeded 149 MiB at once). The profiler's
    ``profile_memory`` records every allocation and free of torch's allocator with its size; summed in
    time order they give the live curve exactly. Uses the profiler's event tree (a private but
    long-standing API); costs a few percent of speed while on.
    """

    def __enter__(self) -> LivePeak:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self.peak, self.end = _live_curve_peak(self._prof)

    @property
    def growth(self) -> int:
        return self.peak


def _live_curve_peak(prof: Any) -> tuple[int, int]:
    """(highest, final) running sum of the profiler's allocation events (frees are negative sizes)."""
    from torch._C._profiler import _EventType

    stack, sizes = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            sizes.append((event.start_time_ns, event.extra_fields.alloc_size))
    live = peak = 0
    for _, size in sorted(sizes, key=lambda x: x[0]):
        live += size
        peak = max(peak, live)
    return peak, live


def live_peak_of_update(trainer: Any, batches: Any) -> Dict[str, int]:
    """Plain updates until the optimizer state exists, then the live-tensor peak and RSS growth of the next."""
    _warm_up(trainer, batches)
    batch = next(batches)
    with RssPeak() as rss, LivePeak() as live:
        trainer.train_step([batch])
    return {"live_peak": live.peak, "rss_growth": rss.growth}


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
    if os.environ.get(MODE_ENV) == "peak":
        mine = live_peak_of_update(trainer, batches)
    else:
        mine = measure_trainer(trainer, batches)
    results: List[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, mine)
    if env.rank == 0:
        with open(os.environ[OUT_ENV], "w") as f:
            json.dump(results, f)


def measure_run(cfg: Any, out: str, peak: bool = False) -> List[Dict[str, int]]:
    """Run :func:`measure_worker` on ``cfg``'s world size (spawned gloo processes); every rank's counts.
    ``peak``: an update's live-tensor peak and RSS growth (:func:`live_peak_of_update`) instead."""
    import json
    import os

    from toolkit.distributed import launch

    os.environ[OUT_ENV] = out
    os.environ[MODE_ENV] = "peak" if peak else "tensors"
    if peak:
        os.environ["TOOLKIT_KEEP_CPU_MEMORY"] = "0"
    launch.run(measure_worker, cfg)
    with open(out) as f:
        return json.load(f)
