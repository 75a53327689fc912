"""``--overlap-offload-step``: the offloaded CPU Adam update runs block by block beside the next forward.

Serially, an offloaded update (``--ddp-backend fully_sharded --cpu-offload --optimizer cpu_adam``)
is backward, then the host gradient norm over all gradients, then CPU Adam over all
parameters, while the GPU waits (345 + 490 ms of a 1,938 ms ``transformer_lm_gpt3_2_7``
update on an H100). With this option:

* **Norm during backward.** As each FSDP2 group's sharded gradients land in host memory
  (its post-backward reduce-scatter), the worker thread waits for that group's D2H copies
  and takes its squares; after backward only the exact sum and one all-reduce remain
  (:class:`toolkit.optim.grad_norm.SquareSums`: the same number as the serial norm).
* **Update in forward order on one worker thread.** The root's own parameters (embeddings,
  final LayerNorm: the root all-gathers them first) go first, then block 0, 1, ...; the
  normalization and clip factor are folded into the update (``CPUAdam.run_step``).
* **Each forward waits only for its own block.** A forward pre-hook on every FSDP2 module,
  put in front of FSDP2's own (which all-gathers the block and, offloaded, copies its host
  parameters to the GPU), waits for that block's update (and for the blocks FSDP2 was told
  to prefetch from there). The root's forward post-hook waits for everything, so backward
  never runs beside an update.
* **Everything else waits for all of it.** Model and optimizer ``state_dict`` /
  ``load_state_dict`` (checkpoints) wait through hooks; the trainer waits before validation,
  EMA and its own state (``Trainer.finish_pending_steps``). An exception in the worker is
  raised again, the same exception object, at the next wait in the main thread.

The result is the serial one bit for bit: CPUAdam's update of a parameter does not depend
on which parameters were updated before it (``CPUAdam._prime_bias_correction``), the
hyperparameters are taken when the update is launched (``CPUAdam.plan_step``, so the LR
schedule can move on), and the norm's pieces are summed exactly.

With ``--bf16-host-grads`` too: its hooks re-store each gradient in bf16 when FSDP2 assigns it,
within the group's post-backward, so the squares and the update read the bf16 gradients, as the
serial run does (a gradient replaced after its squares were taken would have them taken again
after backward: ``raw_grad_norm`` checks identity). Bit for bit the serial run with 2 ranks and
8-bit moments (``tests/{unit,integration}/test_overlap.py``).

Under ``--expert-parallel-size`` each placed expert stack is an FSDP2 group of its own, and each ep rank holds
other experts: their squares are kept apart and added over the ep ranks after backward, before the clip factor
is formed (``ExpertGradients.norm_of``, the serial ``global_grad_norm``'s arithmetic), so every rank clips by the
whole model's norm (``tests/integration/test_moe_train.py``).

Under ``--pipeline-parallel-size`` each rank holds its stages' layers only: the norm's squares are added over the
pp ranks too (as ``Pipeline.global_norm`` does serially). A stage's backward reduce-scatters once per micro-batch
of the schedule, FSDP2 adding each into the sharded gradient in place, so a group's squares are taken again
after each of them (the queued ones of an earlier micro-batch cancelled): the last are those of the whole sum.

DeepSpeed binds its op without releasing the GIL, which would stall the main thread for the
whole of each update call: :mod:`toolkit.optim.gil_free_adam` builds the same update under a
binding that releases it (falling back to DeepSpeed's, with a WARNING, if it cannot be built).

FSDP2 internals used (torch 2.13; checked when the overlap is set up): each module's
``FSDPParamGroup.post_backward`` is wrapped to learn when its gradients land (torch's public
post-accumulate-grad hooks on the sharded parameters would make FSDP2's D2H gradient copies
synchronous), with ``FSDPParam.grad_offload_event`` telling when they are in host memory,
and ``FSDPState._states_to_forward_prefetch`` for the prefetch targets.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from toolkit.config import TrainConfig
from toolkit.core.errors import UserError
from toolkit.optim.gil_free_adam import use_gil_free_op
from toolkit.optim.grad_norm import SquareSums

logger = logging.getLogger(__name__)


def build_offload_overlap(
    cfg: TrainConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    expert_grads: Any = None,
    pipeline: Any = None,
) -> Optional[OffloadOverlap]:
    """The overlap ``--overlap-offload-step`` asks for (None without the flag); bad combinations are UserErrors.
    ``expert_grads``: under ``--expert-parallel-size`` the strategy's ``ExpertGradients`` (which parameters are
    this rank's experts, and the ep group their squares are added over); ``pipeline``: under
    ``--pipeline-parallel-size`` the strategy's ``Pipeline`` (its pp group, over which the stages' squares add)."""
    dist_cfg = cfg.distributed
    if not dist_cfg.overlap_offload_step:
        return None
    if dist_cfg.ddp_backend != "fully_sharded" and dist_cfg.model_parallel_size == 1:
        raise UserError(
            "--overlap-offload-step: needs --ddp-backend fully_sharded (it updates FSDP2's blocks one "
            "by one); add --ddp-backend fully_sharded --cpu-offload or drop the flag"
        )
    if cfg.components.optimizer != "cpu_adam":
        raise UserError(
            f"--overlap-offload-step: needs --optimizer cpu_adam (the update in host memory), got "
            f"--optimizer {cfg.components.optimizer}; use --optimizer cpu_adam or drop the flag"
        )
    if cfg.optimizer.fp16_adam_stats:
        raise UserError(
            "--overlap-offload-step: --fp16-adam-stats all-reduces per-tensor scales inside the update, "
            "which cannot run beside the forward's collectives; drop one of the two flags"
        )
    if cfg.ema.store_ema:
        logger.info(
            "--overlap-offload-step with --store-ema: the EMA reads every weight after each update, "
            "so each update waits for the whole step (no overlap)"
        )
    overlap = OffloadOverlap(model, optimizer, expert_grads, pipeline.group if pipeline is not None else None)
    logger.info(
        f"--overlap-offload-step: CPU Adam steps {len(overlap.groups)} parameter groups in forward order "
        f"on a background thread"
    )
    return overlap


@dataclass
class _Group:
    """One FSDP2 module's own parameters (a block, or the root's embeddings and final LayerNorm)."""

    module: torch.nn.Module
    param_group: Any  # FSDP2's FSDPParamGroup
    params: List[torch.Tensor]


def fsdp_groups(model: torch.nn.Module) -> List[_Group]:
    """The FSDP2 modules holding parameters, root first, then in registration (= forward) order."""
    from torch.distributed.fsdp import FSDPModule

    groups = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        param_group = module._get_fsdp_state()._fsdp_param_group
        if param_group is None:
            continue
        if not hasattr(param_group, "post_backward") or not all(
            hasattr(fp, "grad_offload_event") for fp in param_group.fsdp_params
        ):
            raise RuntimeError(
                "--overlap-offload-step: this torch's FSDP2 lacks FSDPParamGroup.post_backward / "
                "FSDPParam.grad_offload_event (written for torch 2.13)"
            )
        groups.append(_Group(module, param_group, [fp.sharded_param for fp in param_group.fsdp_params]))
    if not groups:
        raise UserError("--overlap-offload-step: the model has no FSDP2 (fully_shard) modules")
    return groups


def _expert_groups(groups: List[_Group], expert_ids: Set[int]) -> Set[int]:
    """The indices of the groups holding placed experts (each stack is its own FSDP2 module: all of a group or none)."""
    out = set()
    for i, group in enumerate(groups):
        placed = [id(p) in expert_ids for p in group.params]
        if any(placed) and not all(placed):
            raise RuntimeError(
                "--overlap-offload-step: an FSDP2 group mixes expert and dense parameters (each placed "
                "expert stack is sharded as a module of its own)"
            )
        if any(placed):
            out.add(i)
    return out


def _match_threads(num_threads: int) -> None:
    """The worker uses the main thread's intra-op thread count (a new thread would get OpenMP's default),
    so its BLAS dots partition -- and round -- as the main thread's do."""
    torch.set_num_threads(num_threads)


class OffloadOverlap:
    """Per-block norm during backward, per-block CPU Adam on one worker thread, per-block waits in forward."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        expert_grads: Any = None,
        stage_group: Any = None,
    ):
        self.model, self.optimizer = model, optimizer
        self.stage_group = stage_group  # the pp group: the other stages hold the model's other layers
        self.groups = fsdp_groups(model)
        self._group_of = {id(p): i for i, g in enumerate(self.groups) for p in g.params}
        self.expert_grads = expert_grads
        self._expert_groups = _expert_groups(self.groups, expert_grads.ids if expert_grads is not None else set())
        wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if wanted != set(self._group_of):
            raise RuntimeError(
                "--overlap-offload-step: the optimizer's parameters are not exactly the FSDP2 modules' parameters"
            )
        use_gil_free_op(optimizer)  # else the main thread waits for the GIL while a chunk updates
        self._pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="offload-step",
            initializer=_match_threads,
            initargs=(torch.get_num_threads(),),
        )
        self._done: List[threading.Event] = []  # per group, of the update in flight
        self._error: Optional[BaseException] = None
        self._norm_tasks: Dict[int, Future] = {}
        self._register_hooks()

    # -- hooks -----------------------------------------------------------------------
    @classmethod
    def _hooks_run_eagerly(cls) -> None:
        """Hooks run eagerly, as FSDP2's own: under --compile a block's compiled call includes its hooks, and
        dynamo cannot trace a thread wait. ``torch._dynamo.disable`` is applied here, when the first overlap is
        built, as a decorator would at import: importing dynamo costs every command a second at start-up."""
        from torch._dynamo import disable

        if not getattr(cls, "_eager", False):
            cls._before_forward, cls._post_backward = disable(cls._before_forward), disable(cls._post_backward)
            cls._eager = True

    def _register_hooks(self) -> None:
        from torch._dynamo import disable as eager

        self._hooks_run_eagerly()
        state_index = {id(g.module._get_fsdp_state()): i for i, g in enumerate(self.groups)}
        for i, group in enumerate(self.groups):
            # prepend: runs before FSDP2's pre-forward (registered with prepend=True when fully_shard ran)
            group.module.register_forward_pre_hook(
                functools.partial(self._before_forward, i, state_index), prepend=True
            )
            original = group.param_group.post_backward
            group.param_group.post_backward = functools.partial(self._post_backward, i, original)
        wait = eager(lambda *_: self.finish())
        self.model.register_forward_hook(wait)
        for owner in (self.model, self.optimizer):
            owner.register_state_dict_pre_hook(wait)
            owner.register_load_state_dict_pre_hook(wait)

    def _before_forward(self, index: int, state_index: Dict[int, int], module: torch.nn.Module, *_: Any) -> None:
        prefetched = module._get_fsdp_state()._states_to_forward_prefetch or []
        self.wait(max([index] + [state_index[id(s)] for s in prefetched if id(s) in state_index]))

    def _post_backward(self, index: int, original, *args: Any) -> Any:
        """FSDP2's post-backward of one group; if it reduce-scattered new gradients, queue their squares."""
        fsdp_params = self.groups[index].param_group.fsdp_params
        before = [(fp.sharded_param.grad, _version(fp.sharded_param.grad)) for fp in fsdp_params]
        out = original(*args)
        after = [fp.sharded_param.grad for fp in fsdp_params]
        if any(g is not None and (g is not b or _version(g) != v) for g, (b, v) in zip(after, before)):
            events = [fp.grad_offload_event for fp in fsdp_params if fp.grad_offload_event is not None]
            earlier = self._norm_tasks.get(index)  # an earlier micro-batch's: its squares miss this one's
            if earlier is not None:
                earlier.cancel()
            self._norm_tasks[index] = self._pool.submit(_squares, [g for g in after if g is not None], events)
        return out

    # -- norm ------------------------------------------------------------------------
    def raw_grad_norm(self) -> float:
        """The global norm of the gradients (as ``total_norm`` of them all), mostly summed during backward."""
        tasks, self._norm_tasks = self._norm_tasks, {}
        total, experts = SquareSums(), SquareSums()
        for i, group in enumerate(self.groups):
            grads = [p.grad for p in group.params if p.grad is not None]
            seen, squares = tasks[i].result() if i in tasks else ([], None)  # re-raises the worker's error
            if squares is None or len(seen) != len(grads) or any(a is not b for a, b in zip(seen, grads)):
                squares = SquareSums()  # not (or not exactly these gradients) seen in backward: now
                squares.add(grads)
            (experts if i in self._expert_groups else total).merge(squares)
        if self.expert_grads is None:
            return self._over_stages(float(total.norm()))
        # expert parallelism: each ep rank holds other experts, so their squares are added over the ep ranks (as
        # ExpertGradients.global_norm does serially: the same float32 norms, squared in float64)
        dense, placed = total.norm().double().square(), experts.norm().double().square()
        return self._over_stages(self.expert_grads.norm_of(dense, placed))

    def _over_stages(self, norm: float) -> float:
        """The norm of every stage's gradients from this rank's (``Pipeline.global_norm``'s arithmetic): the squares
        summed over the pp group, in host memory (the offloaded gradients' collectives run on gloo)."""
        if self.stage_group is None:
            return norm
        square = torch.tensor([norm], dtype=torch.float64).square()
        torch.distributed.all_reduce(square, group=self.stage_group)
        return math.sqrt(float(square))

    # -- update ----------------------------------------------------------------------
    def launch_step(self, grad_scale: float) -> None:
        """Start the update (gradients times ``grad_scale``); it drops each gradient once its parameter is stepped."""
        self.finish()
        parts: List[List[Tuple[torch.Tensor, Dict[str, Any]]]] = [[] for _ in self.groups]
        for p, hyper in self.optimizer.plan_step():
            parts[self._group_of[id(p)]].append((p, hyper))
        self._done = [threading.Event() for _ in self.groups]
        self._pool.submit(self._run, parts, grad_scale, self._done)

    def _run(
        self,
        parts: Sequence[List[Tuple[torch.Tensor, Dict[str, Any]]]],
        grad_scale: float,
        done: Sequence[threading.Event],
    ) -> None:
        for part, event in zip(parts, done):
            try:
                if self._error is None:
                    self._step_part(part, grad_scale)
            except BaseException as e:  # handed to the main thread at its next wait
                self._error = e
            finally:
                event.set()

    def _step_part(self, part: List[Tuple[torch.Tensor, Dict[str, Any]]], grad_scale: float) -> None:
        self.optimizer.run_step(part, grad_scale)
        for p, _ in part:
            p.grad = None

    def wait(self, index: int) -> None:
        """Block until group ``index`` (and the ones before it: the worker goes in order) is updated."""
        if index < len(self._done):
            self._done[index].wait()
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        """Block until the whole update in flight is done (raising the worker's exception, if any)."""
        for event in self._done:
            event.wait()
        if self._error is not None:
            raise self._error

    @property
    def pending(self) -> bool:
        return any(not event.is_set() for event in self._done)


def _version(grad: Optional[torch.Tensor]) -> Optional[int]:
    """A sharded gradient's version: FSDP2 adding a later micro-batch's gradient into it in place moves it."""
    from toolkit.core.dtensor import local_tensor

    return None if grad is None else local_tensor(grad)._version


def _squares(grads: List[torch.Tensor], events: List[Any]) -> Tuple[List[torch.Tensor], SquareSums]:
    """On the worker: wait for the D2H copies of these gradients, then their squares."""
    for event in events:
        event.synchronize()
    squares = SquareSums()
    squares.add(grads)
    return grads, squares
