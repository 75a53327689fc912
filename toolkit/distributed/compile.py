"""``--compile``: ``torch.compile`` each transformer block, applied from outside the model (torchtitan's
``apply_compile``).

Why per block: the blocks are identical, so dynamo traces one graph and every layer reuses it
(parameters are graph inputs), which keeps compile time independent of depth; the embedding,
the output layer and the loss stay eager. ``block.compile()`` compiles in place, so the
module tree, parameter names and state-dict keys are the eager model's (no ``_orig_mod.``):
checkpoints move freely between compiled and eager runs.

Order in ``parallelize`` (torchtitan's): activation checkpointing (the compiled module is
then the checkpoint wrapper, so dynamo sees the recomputation region), compile, then FSDP2
``fully_shard`` or DDP. Under tensor parallelism (after the split, before FSDP2) only the block's
``forward`` is compiled: the per-rank random-number hooks on the block (``torch.manual_seed`` of a
forked generator, which dynamo cannot put in a graph) then run eagerly around it.
Each block is compiled with ``fullgraph=True``: a graph break inside a block is an error
rather than a silent slowdown. Two splits run a collective inside the block, each behind
``torch.compiler.disable``, so the block is a few graphs around one eager call: under
``--expert-parallel-size`` the token exchange, under ``--context-parallel-size`` the attention over the
gathered keys/values (its tiles follow each batch's document boundaries: Python decisions a graph would
guard on, recompiling per batch). Under context parallelism the compiled code is the block's own
``forward``, inside an activation-checkpointing wrapper: dynamo captures a checkpointed region only as one
whole graph, and a break in it would leave the whole block eager.

Under ``--pipeline-parallel-size`` each rank compiles the blocks of its stages (the other entries of
``model.layers`` are empty slots). A block sees a micro-batch, and the pipeline pads each batch to equal
micro-batches, so a block compiles once per batch shape, as in one process; the pipelining library's shape
inference (a forward and backward of the stage on empty tensors of the micro-batch's shapes, before the
schedule's first step) runs the same compiled graphs.

The backend is inductor. ``TOOLKIT_COMPILE_BACKEND`` names another registered
``torch.compile`` backend (e.g. ``aot_eager``: the same graph capture and autograd
transformation without code generation; the tests use it where inductor's compile time
would dominate). Inductor caches compiled kernels on disk (``TORCHINDUCTOR_CACHE_DIR``,
default under the temp folder), so a second run with the same shapes compiles much faster.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from typing import List, Optional

import torch

from toolkit.core.errors import UserError

logger = logging.getLogger(__name__)

BACKEND_ENV = "TOOLKIT_COMPILE_BACKEND"
DEFAULT_BACKEND = "inductor"


def compile_backend(device: torch.device) -> str:
    """The ``torch.compile`` backend of this run, checked before any block is compiled."""
    backend = os.environ.get(BACKEND_ENV) or DEFAULT_BACKEND
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise UserError(f"{BACKEND_ENV}={backend}: not a torch.compile backend; choose from {', '.join(known)}")
    if backend == "inductor" and device.type == "cpu" and not _cxx_compiler_present():
        raise UserError(
            "--compile: inductor builds CPU kernels with a C++ compiler and none was found "
            f"(g++ or $CXX); install one, or set {BACKEND_ENV}=aot_eager"
        )
    return backend


def _cxx_compiler_present() -> bool:
    return any(shutil.which(name) for name in (os.environ.get("CXX"), "g++", "c++", "clang++") if name)


def apply_compile(
    model: torch.nn.Module, device: torch.device, hooks_eager: bool = False, eager_region: Optional[str] = None
) -> None:
    """Compile every block of ``model.layers`` in place and log the cost of the first training passes.

    ``hooks_eager``: compile only the block's own ``forward`` (inside an activation-checkpointing
    wrapper), so the forward hooks on the block stay outside the compiled code. Tensor parallelism
    needs this: its per-rank random-number hooks reseed the generator (``torch.manual_seed``), which
    dynamo cannot capture in a graph, around the block. So does context parallelism under
    ``--checkpoint-activations``: dynamo takes a checkpointed region only as one graph, and the eager
    attention inside would leave the whole block uncompiled (expert parallelism's exchange likewise).

    ``eager_region``: what runs eagerly inside each block (``torch.compiler.disable``), which makes the block
    several graphs instead of one (no ``fullgraph``). Expert parallelism: its token exchange
    (``GroupedExperts._exchange_and_run``) between the graph of the attention and router and the graph of
    the combine. Context parallelism: the attention over the gathered keys/values (``ContextShard.attend``)
    between the projections and ``o_proj``. So do a MoE layer's own FSDP2 hooks under tensor parallelism
    (``toolkit.distributed.expert_parallel.shard_moe_replicated_over_tp``).
    """
    backend = compile_backend(device)
    fullgraph = eager_region is None
    blocks = [block for block in model.layers if block is not None]  # a pipeline stage holds only its layers
    for block in blocks:
        if hooks_eager:
            inner = block._checkpoint_wrapped_module if hasattr(block, "_checkpoint_wrapped_module") else block
            inner.forward = torch.compile(inner.forward, backend=backend, fullgraph=fullgraph)
        else:
            block.compile(backend=backend, fullgraph=fullgraph)
    CompileTimeLog(model, backend)
    graphs = "fullgraph" if fullgraph else f"graphs around {eager_region}"
    logger.info(
        f"--compile: torch.compile ({backend}, {graphs}) on each of the {len(blocks)} blocks; "
        f"the first training pass compiles them (forward and backward)"
    )


class CompileTimeLog:
    """One INFO line with the time the compilation costs, measured where it is paid.

    Compilation happens lazily inside the first training pass (forward, and backward once
    gradients flow), so its cost shows as the gap between the first and the second pass:
    the time from one training forward to the next, taken by a pre-hook on the (eager) root
    module. Evaluation passes (``eval()`` or no grad) are not counted. Runs of fewer than
    three training passes log nothing. Under a pipeline a pass is a stage's forward of one micro-batch.
    """

    def __init__(self, model: torch.nn.Module, backend: str):
        self.backend = backend
        self.starts: List[float] = []
        self.handle = model.register_forward_pre_hook(self._on_forward)

    def _on_forward(self, module: torch.nn.Module, args) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        self.starts.append(time.perf_counter())
        if len(self.starts) < 3:
            return
        first, second = self.starts[1] - self.starts[0], self.starts[2] - self.starts[1]
        logger.info(
            f"--compile: the first training pass took {first:.1f} s, the second {second:.2f} s: "
            f"about {max(first - second, 0.0):.1f} s compiling ({self.backend})"
        )
        self.handle.remove()
