"""Throughput and model FLOPs utilisation (MFU).

* :func:`peak_flops` - the device's dense peak FLOP/s for a dtype: the datasheet
  number for known GPUs (:data:`GPU_PEAK_TFLOPS`), a large-matmul measurement on
  CPU (:func:`measure_cpu_peak_flops`, cached per machine) or on an unknown GPU.
* :func:`mfu` - achieved / peak.
* :class:`ThroughputSpec` - what ``metrics.log_throughput`` turns into ``tps``/``mfu``.

Pure computation: the training loop logs the metrics; FLOPs per token come from the model.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch

from toolkit import ops
from toolkit.core import machine_cache

logger = logging.getLogger(__name__)

# Dense (no sparsity) datasheet peaks in TFLOP/s: (regex on torch.cuda.get_device_name(), {dtype: TFLOP/s}).
# "fp32" is plain FP32 (no TF32); "tf32" is the tensor-core TF32 rate. First match wins.
GPU_PEAK_TFLOPS = [
    (r"GH200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"H100.*NVL", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.8, "fp32": 60.0}),
    (r"H100.*PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    (r"H100|H800", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM
    (r"B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0}),
    (r"A100|A800", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"V100.*PCIE", {"fp16": 112.0, "fp32": 14.0}),
    (r"V100", {"fp16": 125.0, "fp32": 15.7}),  # SXM2
    (r"L40S", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"\bT4\b", {"fp16": 65.0, "fp32": 8.1}),
    (r"MI300X", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
    (r"MI250X?", {"bf16": 383.0, "fp16": 383.0, "fp32": 47.9}),
]

_DTYPE_KEY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

DtypeLike = Union[torch.dtype, str]


def _dtype_key(dtype: DtypeLike) -> str:
    if isinstance(dtype, str):
        return {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}.get(
            dtype, dtype
        )
    if dtype not in _DTYPE_KEY:
        raise ValueError(f"no peak FLOP/s for dtype {dtype}")
    return _DTYPE_KEY[dtype]


def gpu_datasheet_peak_flops(
    device_name: str, dtype: DtypeLike = torch.bfloat16, allow_tf32: bool = False
) -> Optional[float]:
    """Datasheet dense peak FLOP/s of the GPU called ``device_name`` for ``dtype``; None if unknown.

    For float32 the TF32 rate is used when ``allow_tf32`` (matmuls run on tensor cores).
    """
    key = _dtype_key(dtype)
    if key == "fp32" and allow_tf32:
        key = "tf32"
    for pattern, table in GPU_PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            tflops = table.get(key)
            if tflops is None and key == "tf32":
                tflops = table.get("fp32")
            return None if tflops is None else tflops * 1e12
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_flops(
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype = torch.float32,
    duration: float = 0.5,
    n: Optional[int] = None,
    max_n: Optional[int] = None,
    min_reps: int = 3,
    kernel: str = "torch",
) -> float:
    """Best FLOP/s of large square matmuls on ``device`` over about ``duration`` seconds (``kernel``: torch's
    ``mm``, or ``"onednn"``: oneDNN's fp32 product on CPU, which the toolkit's layers use where it is faster).

    The matrix size starts at ``n`` (2048 on CPU, 4096 on GPU) and doubles, up to
    ``max_n`` (4096 on CPU, 16384 on GPU), while one matmul takes under 50 ms (CPU) /
    10 ms (GPU). The result goes into a preallocated output, so the figure is the
    kernel's rate, not the allocator's. Then matmuls run in chunks of about 50 ms (one
    matmul per chunk on a CPU) until ``duration`` is spent and at least ``min_reps``
    chunks ran, and the best chunk's rate is returned: the least disturbed one when
    other processes share the machine.

    Why large: with 2 threads on a 2-core VM, 1024-square fp32 matmuls reached only
    65-110 GFLOP/s against 180-195 for 2048-4096 (one thread: ~100 at every size), so
    the earlier 1024 start under-measured the peak by up to 2x and inflated the MFU.
    """
    device = torch.device(device)
    cpu = device.type == "cpu"
    explicit_n = n
    if n is None:
        n = 2048 if cpu else 4096
    if max_n is None:
        max_n = max(n, 4096 if cpu else 16384)
    grow_below = 0.05 if cpu else 0.01
    gen = torch.Generator(device="cpu").manual_seed(0)
    if cpu and explicit_n is None:
        # A dtype without fast CPU kernels (fp16 on most CPUs: ~0.4 GFLOP/s) would take minutes at
        # 2048: estimate the rate with a 256-square matmul and start where one takes at most ~0.5 s.
        p = torch.randn(256, 256, generator=gen).to(dtype=dtype)
        torch.mm(p, p)
        t0 = time.perf_counter()
        torch.mm(p, p)
        rate = 2.0 * 256**3 / max(time.perf_counter() - t0, 1e-9)
        while n > 256 and 2.0 * n**3 / rate > 0.5:
            n //= 2
    while True:
        a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
        b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
        c = torch.empty(n, n, device=device, dtype=dtype)
        product = _product(a, b, c, kernel)
        product()  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        product()
        _sync(device)
        one = time.perf_counter() - t0
        if one >= grow_below or n * 2 > max_n:
            break
        n *= 2
    flops_per_mm = 2.0 * n**3
    per_chunk = max(1, int(0.05 / max(one, 1e-6)))
    best = flops_per_mm / one if one > 0 else 0.0
    deadline = time.perf_counter() + duration
    reps = 0
    while reps < min_reps or time.perf_counter() < deadline:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(per_chunk):
            product()
        _sync(device)
        dt = time.perf_counter() - t0
        reps += 1
        if dt > 0:
            best = max(best, per_chunk * flops_per_mm / dt)
    return best


def _product(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, kernel: str):
    """One matmul of ``a`` and ``b``: torch's into the preallocated ``c``, or oneDNN's (which allocates its
    output: at the sizes measured, <1% of the product's time)."""
    if kernel == "onednn":
        return lambda: ops.onednn_product(a, b)
    return lambda: torch.mm(a, b, out=c)


def best_matmul_flops(device: Union[str, torch.device], dtype: torch.dtype, duration: float = 0.5) -> float:
    """:func:`measure_matmul_flops` with torch's matmul, and for fp32 on a CPU also with oneDNN's (which the
    toolkit's products use where the switch selected it, ``toolkit.ops``): the best of the two."""
    flops = measure_matmul_flops(device, dtype, duration=duration)
    if torch.device(device).type == "cpu" and dtype == torch.float32 and ops.onednn_available():
        flops = max(flops, measure_matmul_flops(device, dtype, duration=duration, kernel="onednn"))
    return flops


_cpu_peak_cache: Dict[Tuple[torch.dtype, int], float] = {}
_cpu_peak_source: Dict[Tuple[torch.dtype, int], str] = {}
CPU_PEAK_CACHE = "cpu_peak.json"


def cpu_peak_cache_path() -> str:
    """Where measured CPU peaks are kept between runs: ``$TOOLKIT_CACHE_DIR`` or ``~/.cache/toolkit``."""
    return machine_cache.path(CPU_PEAK_CACHE)


def _machine_key(dtype: torch.dtype, threads: int) -> str:
    """The same CPU model, core count, torch build, dtype and thread count give the same peak (the best of torch's
    BLAS and oneDNN for fp32: ``toolkit.ops``)."""
    return machine_cache.key(_dtype_key(dtype), f"{threads} threads", "best of torch and oneDNN")


def plausible_cpu_peak(threads: int) -> Tuple[float, float]:
    """FLOP/s a CPU's matmuls can reach with ``threads`` threads: from 10 MFLOP/s (fp16 without fast kernels runs
    at ~0.4 GFLOP/s) to 10 TFLOP/s per thread (AMX bf16 reaches 1-2 per core); a cached peak outside is no
    measurement (``1e30`` would print every MFU as 0, ``1e-3`` as 100%)."""
    return 1e7 * max(1, threads), 1e13 * max(1, threads)


def measure_cpu_peak_flops(
    dtype: torch.dtype = torch.float32, threads: Optional[int] = None, duration: float = 0.5
) -> float:
    """Peak FLOP/s of this CPU for ``dtype`` with ``threads`` threads (default: torch's), measured.

    Runs square matmuls for about ``duration`` seconds the first time on a machine and keeps the result in
    :func:`cpu_peak_cache_path` (per CPU model, core count, torch build, dtype and threads) and for the rest of
    the process: the probe took 0.3-1 s of every run's start (2 s for bf16, which also measures fp32). Why a
    file: the peak of a machine does not change between runs; delete the file to measure again. A figure read
    from it outside :func:`plausible_cpu_peak` is measured again, and one measured while other processes used
    the CPUs is provisional (``toolkit.core.machine_cache``). :func:`cpu_peak_source` says where the figure
    came from.
    """
    if threads is None:
        threads = torch.get_num_threads()
    key = (dtype, int(threads))
    if key in _cpu_peak_cache:
        return _cpu_peak_cache[key]
    path, name = cpu_peak_cache_path(), str(dtype).replace("torch.", "")

    def measure() -> float:
        previous = torch.get_num_threads()
        torch.set_num_threads(int(threads))
        try:
            return best_matmul_flops("cpu", dtype, duration=duration)
        finally:
            torch.set_num_threads(previous)

    flops, measured = machine_cache.kept_or_measured(
        path, _machine_key(dtype, int(threads)), "flops", measure, within=plausible_cpu_peak(int(threads))
    )
    _cpu_peak_cache[key] = flops
    when = f"measured {measured}, kept in {path}: delete it to measure again" if measured else f"kept in {path}"
    _cpu_peak_source[key] = f"{name}, {threads} threads; {when}"
    logger.debug(f"CPU peak: {flops / 1e9:.1f} GFLOP/s ({_cpu_peak_source[key]})")
    return flops


def cpu_peak_source(dtype: torch.dtype, threads: int) -> str:
    """Where this process's CPU peak for ``dtype`` and ``threads`` came from (a measurement now, or the file and
    its date), for the one line a run logs about its MFU peak; empty before :func:`measure_cpu_peak_flops`."""
    return _cpu_peak_source.get((dtype, int(threads)), "")


def peak_flops(
    device: Union[str, torch.device, None] = None,
    dtype: torch.dtype = torch.bfloat16,
    allow_tf32: Optional[bool] = None,
) -> float:
    """Dense peak FLOP/s of one ``device`` for ``dtype``, for MFU.

    CUDA: the datasheet number by ``torch.cuda.get_device_name``; an unknown GPU is
    measured (and a warning logged). CPU: :func:`measure_cpu_peak_flops`.
    """
    device = (
        torch.device(device)
        if device is not None
        else (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    )
    if device.type == "cuda":
        if allow_tf32 is None:
            allow_tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
        name = torch.cuda.get_device_name(device)
        peak = gpu_datasheet_peak_flops(name, dtype, allow_tf32=allow_tf32)
        if peak is None:
            peak = measure_matmul_flops(device, dtype)
            logger.warning(f"no datasheet peak for {name!r}; measured {peak / 1e12:.1f} TFLOP/s ({dtype}) for MFU")
        return peak
    return measure_cpu_peak_flops(dtype)


def cuda_gb_free(device: Union[str, torch.device, None] = None) -> float:
    """GiB of the GPU not used at the peak since the last call (fairseq's ``gb_free``); resets the peak."""
    total = torch.cuda.get_device_properties(device).total_memory / 1024**3
    used = torch.cuda.max_memory_allocated(device) / 1024**3
    torch.cuda.reset_peak_memory_stats(device)
    return total - used


def mfu(achieved_flops_per_sec: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation as a fraction (0..1) of ``peak``; None when the peak is unknown."""
    if not peak or peak <= 0:
        return None
    return float(achieved_flops_per_sec) / float(peak)


@dataclass(frozen=True)
class ThroughputSpec:
    """What ``tps``/``mfu`` are computed from: the model's FLOPs per trained token (the model says,
    ``flops_per_token``), one device's peak FLOP/s, and the devices sharing an update's tokens."""

    flops_per_token: float
    peak_flops: Optional[float]
    world_size: int = 1


def per_process_cpu_peak(machine_peak: float, local_world_size: int) -> float:
    """One process's share of the CPU peak when ``local_world_size`` processes share the machine.

    Measuring in every process while the others compute under-reads the peak (a 2-process
    run on 2 cores once logged an MFU of 149%): the peak is measured once per machine, with
    the threads of all local processes, and split between them.
    """
    return machine_peak / max(1, local_world_size)
