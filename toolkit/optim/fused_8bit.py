"""``--adam-state-precision 8bit`` in one pass: a C++ kernel decodes, updates and re-encodes each block in cache.

Why: the eager codec (:mod:`toolkit.optim.quantized_states`) is about 30 elementwise passes
over each slice, each a trip through memory; its 8-bit step took 8-24x the fp32 one (51.7M
parameters: 3-9 s against 0.37 s). ``csrc/adam_8bit.cpp`` takes one block (at most 2048
values of a row) at a time on each OpenMP thread: the two codes decoded to fp32 buffers
that stay in L1, DeepSpeed's Adam update on them (its own ``cpu_adam_impl.cpp``, built with
its builder and flags), the new codes and scales.

The same bits as the eager path (``tests/{unit,integration}/test_adam_states.py`` compares codes, scales and
parameters with ``torch.equal``): every step of the codec is one IEEE operation done in the
eager order, exp_avg_sq's log code goes through the same two tables
(``quantized_states.SQ_RATIO``, ``SQ_THRESHOLD``), and the values that the eager path's
DeepSpeed call gives to its scalar tail get DeepSpeed's scalar code in the kernel too.
``python -m benchmarks.adam_states codes`` checks the kernel's encoder against the eager one
on every float in (0, 1].

Built once per machine (torch's extension cache, like DeepSpeed's op; one INFO line while it
builds). If it cannot be built (no compiler, a failed build): one WARNING, and the eager path.
Parameters other than fp32 (and gradients other than fp32/bf16/fp16) take the eager path.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Optional, Sequence

import torch

from toolkit.optim import quantized_states as qs

logger = logging.getLogger(__name__)

NAME = "toolkit_adam_8bit"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "adam_8bit.cpp")
CXX_ARGS = ("-fno-math-errno", "-fno-trapping-math")
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_state: Dict[str, Any] = {}  # "op": the module, or None once a build failed


def fused_op() -> Optional[Any]:
    """The kernel's module, built on first use; None (after one WARNING) if it cannot be built."""
    if "op" not in _state:
        try:
            _state["op"] = _build()
        except Exception as e:  # no compiler, a failed build: the eager codec still works
            _state["op"] = None
            logger.warning(
                f"--adam-state-precision 8bit: the fused 8-bit Adam kernel could not be built "
                f"({str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}); "
                "using the eager codec, whose step is several times slower"
            )
    return _state["op"]


def _build() -> Any:
    from toolkit.optim.deepspeed_op import build_like_cpu_adam, cxx_compiler, stable_source

    if cxx_compiler() is None:
        raise RuntimeError("no C++ compiler (g++) found")
    with open(SOURCE) as f:  # compiled from one path per machine, not from this checkout (stable_source)
        source = stable_source(NAME, os.path.basename(SOURCE), f.read())
    # errno and FP traps only: without them sqrt and selects vectorize; every result stays the IEEE one
    return build_like_cpu_adam(
        NAME,
        [source],
        include_paths=["csrc/adam"],
        extra_cxx_args=CXX_ARGS,
        purpose="--adam-state-precision 8bit: the fused 8-bit Adam kernel",
    )


def update(
    param: torch.Tensor,
    grad: torch.Tensor,
    moments: Sequence[torch.Tensor],
    hyper: Sequence,
    grad_scale: float,
    span_rows: int,
) -> bool:
    """One AdamW step of a (rows, values per row) fp32 ``param`` with 8-bit ``moments`` (exp_avg, exp_avg_sq
    and their scales, local tensors), in place; False (nothing done) where the eager path must do it.

    ``hyper`` is (step, lr, beta1, beta2, eps, weight_decay, bias_correction); ``span_rows`` the rows
    per slice of the eager path (DeepSpeed's scalar tail is at the end of each slice).
    """
    op = fused_op()
    if op is None or param.dtype != torch.float32 or grad.dtype not in GRAD_DTYPES:
        return False
    op.adam_8bit_step(
        param, grad.contiguous(), *moments, qs.SQ_RATIO, qs.SQ_THRESHOLD, qs.BLOCK, span_rows, *hyper, float(grad_scale)
    )
    return True
