"""The process's fp32 CPU matmul library: chosen once, when a command starts, and in force for every product after.

Why a switch: on some CPUs oneDNN computes fp32 products 1.5-2.4x faster than torch's BLAS (MKL runs AVX2 code on
AMD CPUs; ``toolkit.core.cpu_gemm`` has the products and the measurement). Where it runs is a property of the
process, not of a model or a loop, so the command sets it once and nothing else asks: the commands (toolkit-train,
-eval-lm, -validate, -generate, -interactive, -eval-harness, the hub's ``from_pretrained``) call :func:`select`
with ``--cpu-matmul`` at their start. Models call plain ``F.linear``; activation checkpointing is torch's own.

How: :func:`select` puts a torch-function mode at the bottom of the calling thread's mode stack, and leaves it
there. It sends every ``F.linear`` (every ``nn.Linear``) to ``cpu_gemm.linear``, which takes oneDNN for plain fp32
CPU tensors of a product big enough to gain and hands anything else (CUDA, bf16/fp16, autocast, DTensor and other
subclasses, export, tracing) to torch; inside a graph being compiled (``--compile``) the product is the opaque
``toolkit::onednn_linear`` op. Every other function passes through unchanged.

The backward pass: a mode's handler runs with the mode off, and ``Tensor.backward`` / ``torch.autograd.backward`` /
``torch.autograd.grad`` are functions the mode sees, so handed on as they are the whole backward would run without
it. Activation checkpointing's recomputation would then take torch's products where the forward took oneDNN's, and
checkpointing refuses the other tensors they save. So the mode runs those three itself: it does their argument
handling and calls autograd's engine with the mode back on the stack. On CPU the engine runs the backward in the
calling thread, where the mode is, so a recomputed forward replays the forward's library.

Three more users of the products call them here rather than through ``F.linear``: a mixture of experts' runs
(:func:`grouped_linear`, :func:`grouped_linear_grads`), the fused output layer, which asks :func:`uses_onednn`
which orientation to sum its weight gradient in, and the MFU line's CPU peak, whose probe times both libraries
(:func:`onednn_product`). Nothing else in the toolkit imports ``cpu_gemm``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from toolkit.core import cpu_gemm

CHOICES = cpu_gemm.CHOICES
uses_onednn = cpu_gemm.uses_onednn
selected = cpu_gemm.selected
onednn_available = cpu_gemm.onednn_available
onednn_product = cpu_gemm.onednn_product  # whatever is selected: the CPU peak's probe measures both libraries


class _MatmulMode(TorchFunctionMode):
    """``F.linear`` to ``cpu_gemm.linear``; the backward entry points run with this mode on (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return cpu_gemm.linear(*args, **kwargs)
        entry = _BACKWARD_ENTRIES.get(func)
        if entry is not None:
            call = inspect.signature(func).bind(*args, **kwargs)
            call.apply_defaults()
            if _runs_here(call.arguments):
                with _back_on_the_stack(self):
                    return entry(**call.arguments)
        return func(*args, **kwargs)


def _runs_here(arguments: Dict[str, Any]) -> bool:
    """Tensors with no ``__torch_function__`` of their own (plain ones, DTensor: what torch's entry point hands to
    the engine as they are), and none of ``grad``'s batched or materialized forms; anything else (a subclass that
    overrides backward, a GradientEdge, an argument torch refuses) gets torch's entry point as it is."""
    if arguments.get("is_grads_batched") or arguments.get("materialize_grads"):
        return False
    if arguments.get("inputs") is not None and not _as_tuple(arguments["inputs"]):
        return False  # torch's own entry point says what is wrong with an empty ``inputs``
    for name in ("self", "tensors", "outputs", "inputs"):
        for t in _as_tuple(arguments.get(name)):
            if not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor and _overrides_torch_function(t):
                return False
    return True


def _overrides_torch_function(t: torch.Tensor) -> bool:
    return getattr(type(t), "__torch_function__", None) is not torch._C._disabled_torch_function_impl


class _back_on_the_stack:
    """The mode pushed again for the engine's run (the handler that runs this has it popped)."""

    def __init__(self, mode: _MatmulMode):
        self.mode = mode

    def __enter__(self):
        torch._C._push_on_torch_function_stack(self.mode)

    def __exit__(self, *exc):
        torch._C._pop_torch_function_stack()


def _as_tuple(tensors) -> tuple:
    return () if tensors is None else (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)


def _run_engine(outputs, grad_outputs, retain_graph, create_graph, inputs, *engine, **engine_kwargs) -> tuple:
    """What ``torch.autograd.backward`` and ``grad`` run after their ``__torch_function__`` check."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    outputs = _as_tuple(outputs)
    grads = _make_grads(outputs, _tensor_or_tensors_to_tuple(grad_outputs, len(outputs)), is_grads_batched=False)
    retain = create_graph if retain_graph is None else retain_graph
    return _engine_run_backward(outputs, grads, retain, create_graph, _as_tuple(inputs), *engine, **engine_kwargs)


def _tensor_backward(self, gradient, retain_graph, create_graph, inputs) -> None:
    _run_engine(self, gradient, retain_graph, create_graph, inputs, allow_unreachable=True, accumulate_grad=True)


def _autograd_backward(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs) -> None:
    grad_tensors = grad_variables if grad_tensors is None else grad_tensors  # torch's deprecated name for it
    _run_engine(tensors, grad_tensors, retain_graph, create_graph, inputs, allow_unreachable=True, accumulate_grad=True)


def _autograd_grad(outputs, inputs, grad_outputs, retain_graph, create_graph, allow_unused, **_unused) -> tuple:
    unused = bool(allow_unused)
    return _run_engine(outputs, grad_outputs, retain_graph, create_graph, inputs, unused, accumulate_grad=False)


_BACKWARD_ENTRIES: Dict[Callable, Callable] = {
    torch.Tensor.backward: _tensor_backward,
    torch.autograd.backward: _autograd_backward,
    torch.autograd.grad: _autograd_grad,
}

_MODE = _MatmulMode()


def _stack() -> List[TorchFunctionMode]:
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


def _place_mode(wanted: bool) -> None:
    """The mode at the bottom of this thread's stack (wanted) or nowhere in it, the modes above it kept in order: a
    command may select inside another mode's context (``with torch.device(...)``), which pops only its own."""
    stack = _stack()
    if (_MODE in stack) == wanted:
        return
    for _ in stack:
        torch._C._pop_torch_function_stack()
    for mode in ([_MODE] if wanted else []) + [m for m in stack if m is not _MODE]:
        torch._C._push_on_torch_function_stack(mode)


def select(choice: Optional[str] = "auto", device: Any = "cpu") -> bool:
    """Decide this process's fp32 CPU matmul library (``--cpu-matmul``: ``auto``, ``onednn`` or ``torch``) and put
    it in force for the calling thread; returns whether oneDNN runs. Off the CPU there is nothing to decide (False).
    ``auto`` measures both once per machine (``cpu_gemm.select`` logs which it took and why). ``None`` keeps what
    the process chose before (an evaluation inside a training run), else is ``auto``."""
    if torch.device(device).type != "cpu":
        return False
    earlier = chosen()
    onednn = earlier if choice is None and earlier is not None else cpu_gemm.select(choice or "auto")
    _place_mode(onednn)
    return onednn


def chosen() -> Optional[bool]:
    """This process's decision: True (oneDNN), False (torch's), None (no command has selected yet)."""
    return cpu_gemm._state["onednn"]


def restore(decision: Optional[bool]) -> None:
    """Put back a decision :func:`chosen` returned (None: undecided, as a fresh process) without measuring."""
    cpu_gemm._state["onednn"] = decision
    _place_mode(bool(decision))


def grouped_linear(rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> Optional[torch.Tensor]:
    """A mixture of experts' runs (``rows`` [M, in] in runs of ``counts`` [E], run e times ``weights[e]``^T) by
    oneDNN, one run at a time, where this process selected it and the runs are big enough to gain; None: the
    caller's own grouped GEMM runs them."""
    if not cpu_gemm.grouped_goes_to_onednn(rows, weights):
        return None
    return cpu_gemm.grouped_linear(rows, weights, counts)


def grouped_linear_grads(
    grad: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, sizes: List[int]
) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """(d rows, d weights) of :func:`grouped_linear` by oneDNN where it takes these runs; None: the caller's."""
    if not cpu_gemm.grouped_goes_to_onednn(rows, weights):
        return None
    return cpu_gemm.grouped_linear_grads(grad, rows, weights, sizes)
