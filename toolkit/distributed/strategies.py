"""How gradients are synchronized and compute is cast: one object per ``--ddp-backend``, never None.

The trainer asks its strategy, and nothing else, around each micro-batch:

``grad_sync(model, enabled)``  skip gradient communication on all but the last micro-batch
``autocast(device, dtype)``     autocast, unless the wrapper already casts (FSDP2's policy)
``forward_context()``           ``--offload-activations``: saved tensors wait in host memory

``loss_context()``              ``--model-parallel-size``: the loss of vocabulary-sharded logits
``shard_sample(sample, pad)``   ``--context-parallel-size``: this rank's chunks of the sequences

``handles_mixed_precision`` tells whether parameters are cast by the wrapper (then
``--memory-efficient-fp16`` needs no fp16 copy of the model on the trainer's side).
``dims`` is the run's parallel layout (``toolkit.distributed.parallel_dims.ParallelDims``): the
trainer, the data loader and the checkpoints ask it for the data-parallel rank, and for the reduction
group and the meshes by axis names (under tensor parallelism the M ranks of one replica see the same batch).
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

from toolkit.core.dtensor import local_tensor
from toolkit.distributed.parallel_dims import ParallelDims


class ParallelStrategy:
    """One process, or a model that needs no gradient communication."""

    name = "none"
    handles_mixed_precision = False

    def __init__(
        self,
        offload_activations: bool = False,
        pin_memory: bool = False,
        dims: Optional[ParallelDims] = None,
        loss_parallel: bool = False,
        expert_grads: Any = None,
    ):
        self.offload_activations = offload_activations
        self.expert_grads = expert_grads  # --expert-parallel-size: the expert shards' all-reduce and norm
        self.pin_memory = pin_memory
        self.dims = dims if dims is not None else ParallelDims.single()
        self.loss_parallel = loss_parallel
        self.pipeline: Any = None  # --pipeline-parallel-size: this rank's stages and schedule (pipeline.Pipeline)

    def grad_sync(self, model: torch.nn.Module, enabled: bool) -> ContextManager:
        return contextlib.nullcontext()

    def autocast(self, device: torch.device, dtype: torch.dtype) -> ContextManager:
        if dtype == torch.float32 or self.handles_mixed_precision:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=dtype)

    def forward_context(self) -> ContextManager:
        if self.offload_activations:
            return torch.autograd.graph.save_on_cpu(pin_memory=self.pin_memory)
        return contextlib.nullcontext()

    def loss_context(self) -> ContextManager:
        """Around the loss's forward *and* backward: torch's ``loss_parallel`` for vocabulary-sharded logits."""
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def shard_sample(self, sample: Dict[str, Any], pad: int) -> Dict[str, Any]:
        """The micro-batch this rank computes: its chunks of each sequence under ``--context-parallel-size``
        (``toolkit.distributed.context_parallel``; ``pad``: the padding index), the whole batch otherwise."""
        shape = self.dims.shape
        if shape.cp == 1:
            return sample
        from toolkit.distributed.context_parallel import shard_sample

        cp_rank = shape.coordinates(self.dims.rank)["cp"]
        return shard_sample(sample, shape.cp, cp_rank, self.dims.group("cp"), pad)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class DDPStrategy(ParallelStrategy):
    """``--ddp-backend c10d``: DistributedDataParallel's bucketed all-reduce, overlapping backward."""

    name = "ddp"

    def grad_sync(self, model: torch.nn.Module, enabled: bool) -> ContextManager:
        if self.expert_grads is not None:
            self.expert_grads.enabled = enabled
        return contextlib.nullcontext() if enabled else model.no_sync()


class AllReduceStrategy(ParallelStrategy):
    """``--ddp-backend no_c10d``: one bucketed all-reduce of all gradients after backward (fairseq's legacy DDP)."""

    name = "no_c10d"

    def __init__(self, params: Iterable[torch.nn.Parameter], world_size: int, group: Any = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.reducer = GradAllReduce(params, world_size, group=group)

    def grad_sync(self, model: torch.nn.Module, enabled: bool) -> ContextManager:
        self.reducer.enabled = enabled
        if self.expert_grads is not None:
            self.expert_grads.enabled = enabled
        return contextlib.nullcontext()


class FSDPStrategy(ParallelStrategy):
    """``--ddp-backend fully_sharded``: FSDP2, which reduce-scatters in backward and casts by its policy.

    The sync flag is read in backward, which runs after the context exits, so it is set
    here and left set (the last micro-batch sets it back).
    """

    name = "fsdp"

    def __init__(self, handles_mixed_precision: bool, **kwargs: Any):
        super().__init__(**kwargs)
        self.handles_mixed_precision = handles_mixed_precision

    def grad_sync(self, model: torch.nn.Module, enabled: bool) -> ContextManager:
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()


class GradAllReduce:
    """After backward, all-reduce the gradients of ``params`` over ``group`` (None: all ranks), divided by
    ``world_size``, in buckets.

    Hooks on every parameter queue one callback at the end of the backward pass of a
    micro-batch whose gradient sync is enabled; gradients accumulate locally otherwise.
    """

    def __init__(
        self, params: Iterable[torch.nn.Parameter], world_size: int, bucket_bytes: int = 64 << 20, group: Any = None
    ):
        self.params = [p for p in {id(p): p for p in params}.values() if p.requires_grad]
        self.world_size, self.group = world_size, group
        self.bucket_bytes = bucket_bytes
        self.enabled = True
        self._queued = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, _param: torch.Tensor) -> None:
        if self.enabled and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)

    @torch.no_grad()
    def _reduce(self) -> None:
        self._queued = False
        for p in self.params:  # a parameter unused on this rank still takes part
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: List[torch.Tensor] = []
        size = 0
        for p in self.params:
            grad = local_tensor(p.grad)  # under TP: this rank's shard, reduced with the ranks holding the same one
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
            if size >= self.bucket_bytes:
                self._all_reduce(bucket)
                bucket, size = [], 0
        if bucket:
            self._all_reduce(bucket)

    def _all_reduce(self, grads: List[torch.Tensor]) -> None:
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.world_size)
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)
