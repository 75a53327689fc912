"""fp32 matrix products on CPU through oneDNN, where this CPU runs them faster than torch's default BLAS.

Why: torch computes an fp32 matmul on CPU with its BLAS (MKL's sgemm in the x86 wheels). MKL chooses its code by
CPU vendor, and on AMD it runs AVX2 code: on a Zen 5 EPYC (full-width AVX-512) two cores reach ~215 GFLOP/s,
where oneDNN, which chooses by instruction set, computes the same products at 410-490 GFLOP/s
(``python -m benchmarks.cpu_gemm``). These are strict fp32 products (no bf16 or tf32 inputs: oneDNN's default
math mode); only the order of the additions differs, as between any two BLAS builds. torch already sends bf16
matmuls on CPU to oneDNN, but not fp32 ones, so the toolkit does it for its own: ``F.linear`` (:func:`linear`,
inside ``--compile``'s graphs as the ``toolkit::onednn_linear`` op), the three products of a layer (:func:`mm_nt`,
:func:`mm_nn`, :func:`mm_tn`) and a mixture of experts' runs when they are big (:func:`grouped_linear`).

Which library runs is decided here (:func:`select`): ``auto`` (the default) times both once per machine on a
few transformer-sized products and keeps the answer beside the CPU peak (``~/.cache/toolkit/cpu_gemm.json``);
``onednn`` and ``torch`` force one. It is put in force by ``toolkit.ops``, the switch the commands set at their
start, which sends every ``F.linear`` of the process here. Anything not a plain fp32 CPU tensor (CUDA, bf16/fp16,
autocast, a DTensor or another tensor subclass, a graph being exported or traced) goes to torch as before, and so
do products too small to gain (:data:`MIN_MULTIPLY_ADDS`).
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from toolkit.core import machine_cache

logger = logging.getLogger(__name__)

CHOICES = ("auto", "onednn", "torch")
CACHE_NAME = "cpu_gemm.json"

_state: Dict[str, Optional[bool]] = {"onednn": None}  # None: not decided yet in this process


def onednn_available() -> bool:
    """torch was built with oneDNN and exposes its linear kernel (x86 and aarch64 wheels do)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _lp(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [m, k] @ w [n, k]^T (+ bias) by oneDNN; either operand may be a transposed view."""
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


# --- the three products of a linear layer ------------------------------------------------------------------------
# oneDNN's call costs a few microseconds more than MKL's: a single row through a small layer (the decoding step of a
# 256-wide model, 256 x 688: 0.6x) is faster in torch; from ~0.5M multiply-adds on, oneDNN wins (1.3-3.8x at 4-512
# rows on this Zen 5, benchmarks/cpu_gemm.py)
MIN_MULTIPLY_ADDS = 1 << 19


def _goes_to_onednn(m: int, k: int, n: int, *tensors: Optional[torch.Tensor]) -> bool:
    return m * k * n >= MIN_MULTIPLY_ADDS and uses_onednn(*tensors)


def mm_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [m, k] @ b [n, k]^T: a layer's forward (b its weight)."""
    return _lp(a, b) if _goes_to_onednn(a.size(0), a.size(1), b.size(0), a, b) else a @ b.t()


def mm_nn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [m, k] @ b [k, n]: the gradient of a layer's input (b its weight [out, in])."""
    return _lp(a, b.t()) if _goes_to_onednn(a.size(0), a.size(1), b.size(1), a, b) else a @ b


def mm_tn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [k, m]^T @ b [k, n]: the gradient of a layer's weight (a the output gradient, b the input).

    oneDNN takes its first operand contiguous (it copies a transposed one) and is 1.5-1.8x faster when that copy
    is of the smaller of ``a`` and ``b`` (every product of a 256-wide Llama and of a [12448 x 512] head), so
    for m > n the transposed product is computed and returned as a transposed view."""
    if not _goes_to_onednn(a.size(1), a.size(0), b.size(1), a, b):
        return a.t() @ b
    return _onednn_tn(a, b)


def _onednn_tn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a^T @ b by oneDNN in its fast orientation (:func:`mm_tn`), whatever :func:`select` decided."""
    if a.size(1) <= b.size(1):
        return _lp(a.t(), b.t())
    return _lp(b.t(), a.t()).t()


# --- F.linear with its backward -----------------------------------------------------------------------------------
class _OneDNNLinear(torch.autograd.Function):
    """y = x W^T + b with the three products of :func:`mm_nt` / :func:`mm_nn` / :func:`mm_tn`; saves x and W, as
    F.linear's autograd does."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        x2 = x.reshape(-1, x.size(-1))
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return _lp(x2, weight, bias).view(*x.shape[:-1], weight.size(0))

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x2, weight = ctx.saved_tensors  # where checkpointed, the forward is recomputed here, in toolkit.ops' mode
        with torch._C.DisableTorchFunction():  # the products are called directly: no mode needs to see these calls
            g2 = grad_y.reshape(-1, grad_y.size(-1))
            grad_x = mm_nn(g2, weight).view(*grad_y.shape[:-1], weight.size(1)) if ctx.needs_input_grad[0] else None
            grad_w = mm_tn(g2, x2) if ctx.needs_input_grad[1] else None
            grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


# --- the same inside a compiled graph (--compile): one opaque call, which inductor leaves as it is -----------------
@torch.library.custom_op("toolkit::onednn_linear", mutates_args=())
def _compiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return _lp(x, weight, bias)


@_compiled_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(x.size(0), weight.size(0))


@torch.library.custom_op("toolkit::onednn_linear_backward", mutates_args=())
def _compiled_linear_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(d x, d weight), both contiguous as the fake below says (a compiled graph trusts its strides)."""
    return mm_nn(grad, weight).contiguous(), mm_tn(grad, x).contiguous()


@_compiled_linear_backward.register_fake
def _(grad, x, weight):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)  # contiguous, whatever the inputs' strides


def _setup_compiled_backward(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _compiled_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_w = _compiled_linear_backward(grad, x, weight)
    return grad_x, grad_w, grad.sum(0) if ctx.has_bias else None


_compiled_linear.register_autograd(_compiled_backward, setup_context=_setup_compiled_backward)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear`` by oneDNN where it is selected and the operands are plain fp32 CPU tensors
    (:func:`uses_onednn`) of a product big enough to gain; else ``F.linear`` itself. In a graph being compiled (not
    exported: an exported graph keeps torch's ops) the product is the ``toolkit::onednn_linear`` op, which inductor
    calls as it is and fuses what is around it."""
    if (
        x.dim() < 2
        or weight.dim() != 2
        or not _goes_to_onednn(x.numel() // max(x.size(-1), 1), weight.size(1), weight.size(0), x, weight, bias)
    ):
        return torch.nn.functional.linear(x, weight, bias)
    shape = (*x.shape[:-1], weight.size(0))
    if torch.compiler.is_compiling():
        return _compiled_linear(x.reshape(-1, x.size(-1)), weight, bias).view(shape)
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return _OneDNNLinear.apply(x, weight, bias)
    return _lp(x.reshape(-1, x.size(-1)), weight, bias).view(shape)


class _OneDNNGroupedLinear(torch.autograd.Function):
    """Run e of ``rows`` (``sizes[e]`` rows) times ``weights[e]^T``, each product by :func:`mm_nt` (a mixture of
    experts' layer: torch's grouped GEMM on CPU multiplies the runs with its BLAS)."""

    @staticmethod
    def forward(ctx, rows, weights, sizes: List[int]):
        ctx.save_for_backward(rows, weights)
        ctx.sizes = sizes
        return _grouped_products(rows, weights, sizes)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        rows, weights = ctx.saved_tensors
        with torch._C.DisableTorchFunction():  # as _OneDNNLinear's backward
            grad_rows, grad_weights = grouped_linear_grads(grad, rows, weights, ctx.sizes, *ctx.needs_input_grad[:2])
        return grad_rows, grad_weights, None


def _grouped_products(rows: torch.Tensor, weights: torch.Tensor, sizes: List[int]) -> torch.Tensor:
    return torch.cat([mm_nt(run, weights[e]) for e, run in enumerate(torch.split(rows, sizes))], dim=0)


def grouped_linear_grads(
    grad: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    sizes: List[int],
    want_rows: bool = True,
    want_weights: bool = True,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(d rows, d weights) of :func:`grouped_linear`, run by run (None where not wanted): d rows = grad_e weights[e],
    d weights[e] = grad_e^T rows_e (also the backward of the experts' compiled op, ``toolkit::grouped_matmul``)."""
    grad_runs, row_runs = torch.split(grad, sizes), torch.split(rows, sizes)
    grad_rows = torch.cat([mm_nn(g, weights[e]) for e, g in enumerate(grad_runs)], dim=0) if want_rows else None
    grad_weights = torch.stack([mm_tn(g, r) for g, r in zip(grad_runs, row_runs)]) if want_weights else None
    return grad_rows, grad_weights


# An expert's run through oneDNN pays from ~16M multiply-adds on average (8 experts of 256 x 256, 512 rows each:
# 1.34x torch's grouped GEMM, forward + backward; 64 experts of 64 x 256 with 256 rows each: 0.7x in a training step,
# where torch's grouped GEMM loops over the runs in C++ and MKL's small products start faster)
GROUPED_MIN_MULTIPLY_ADDS = 1 << 24


def grouped_goes_to_onednn(rows: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether a mixture of experts' runs (``rows`` [M, in], ``weights`` [E, out, in]) go through oneDNN one at a
    time (:func:`grouped_linear`) rather than torch's grouped GEMM: oneDNN is selected, the operands are plain fp32
    CPU tensors, and the average run is big enough (:data:`GROUPED_MIN_MULTIPLY_ADDS`)."""
    per_run = rows.size(0) / max(weights.size(0), 1) * weights.size(1) * weights.size(2)
    return per_run >= GROUPED_MIN_MULTIPLY_ADDS and uses_onednn(rows, weights)


def grouped_linear(rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """rows [M, in] in runs of ``counts`` [E] rows, run e times ``weights[e]`` [out, in]^T -> [M, out], each run's
    products by oneDNN (for operands :func:`uses_onednn` accepts)."""
    sizes = counts.tolist()
    if torch.is_grad_enabled() and (rows.requires_grad or weights.requires_grad):
        return _OneDNNGroupedLinear.apply(rows, weights, sizes)
    return _grouped_products(rows, weights, sizes)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def uses_onednn(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether products of these operands go to oneDNN: it was selected, and every one is a plain fp32 CPU tensor,
    outside autocast (which casts F.linear's inputs below this layer), tracing and export."""
    if not _state["onednn"]:
        return False
    for t in tensors:
        if t is None:
            continue
        if type(t) not in _PLAIN or t.dtype != torch.float32 or t.device.type != "cpu":
            return False
    return not (torch.is_autocast_enabled("cpu") or torch.jit.is_tracing() or torch.compiler.is_exporting())


# --- which library: measured once per machine ---------------------------------------------------------------------
# (m, k, n) of a 256- to 1024-wide model's forward and weight-gradient products, and an output layer's
_PROBE_SHAPES: List[Tuple[int, int, int]] = [(512, 512, 1024), (512, 256, 4096)]


def best_seconds(fn, reps: int = 2) -> float:
    """The fastest of ``reps`` calls of ``fn`` after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_speedup(threads: Optional[int] = None) -> float:
    """torch's time / oneDNN's on :data:`_PROBE_SHAPES` (forward and weight-gradient products), best of 2 each:
    above 1, oneDNN is faster. About 0.1 s on two cores."""
    threads = threads or torch.get_num_threads()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        ours = theirs = 0.0
        for m, k, n in _PROBE_SHAPES:
            x, w, dy = (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(m, n, generator=g))
            theirs += best_seconds(lambda: x @ w.t()) + best_seconds(lambda: dy.t() @ x)
            ours += best_seconds(lambda: _lp(x, w)) + best_seconds(lambda: _onednn_tn(dy, x))
        return theirs / ours
    finally:
        torch.set_num_threads(previous)


def select(choice: str = "auto") -> bool:
    """Decide, for this process, whether fp32 CPU products go to oneDNN (``--cpu-matmul``); returns the decision.

    ``auto``: oneDNN when it is at least 10% faster on this machine's probe (:func:`measure_speedup`), measured
    once per CPU model, core count, torch build and thread count and kept in ``$TOOLKIT_CACHE_DIR/cpu_gemm.json``
    (delete it to measure again)."""
    if choice not in CHOICES:
        raise ValueError(f"--cpu-matmul: {choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "torch" or not onednn_available():
        if choice == "onednn":
            logger.warning("--cpu-matmul onednn: this torch build has no oneDNN linear kernel; using torch's")
        _state["onednn"] = False
        return False
    if choice == "onednn":
        _state["onednn"] = True
        return True
    threads = torch.get_num_threads()
    path = machine_cache.path(CACHE_NAME)
    speedup, _ = machine_cache.kept_or_measured(
        path, machine_cache.key(f"{threads} threads"), "speedup", lambda: round(measure_speedup(threads), 3)
    )
    _state["onednn"] = speedup >= 1.1
    logger.info(
        f"CPU fp32 matmuls: {'oneDNN' if _state['onednn'] else 'torch'} (oneDNN {speedup:.2f}x torch's "
        f"on this CPU, {threads} threads; kept in {path}; --cpu-matmul to choose)"
    )
    return bool(_state["onednn"])


def selected() -> bool:
    """Whether this process sends fp32 CPU products to oneDNN (False until :func:`select` runs)."""
    return bool(_state["onednn"])


def onednn_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b^T by oneDNN whatever :func:`select` decided (the CPU peak's probe measures both libraries)."""
    return _lp(a, b)
