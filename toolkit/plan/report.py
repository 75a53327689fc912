"""How a plan reads: the per-rank table, the verdict with its reason and the first flag to change, and the
one-line summary ``toolkit-train --plan`` logs."""

from __future__ import annotations

from typing import Any, List, Tuple

from toolkit.plan.hardware import GIB
from toolkit.plan.memory import Item


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _layout(plan: Any) -> str:
    s = plan.setup
    kind = f"fully_sharded {s.strategy}" if s.backend == "fully_sharded" else s.backend
    extra = (
        (f", TP {s.mp}" if s.mp > 1 else "")
        + (", cpu-offload" if s.cpu_offload else "")
        + (", checkpointed" if s.checkpoint else "")
    )
    return f"{s.world} rank(s), {kind}{extra}, {'bf16/fp16' if s.compute_bytes == 2 else 'fp32'}"


def verdict(plan: Any) -> str:
    hw = plan.hw
    gpu = f"GPU {_gib(plan.gpu_peak)} of {_gib(hw.gpu_memory)}" if hw.has_gpu else "no GPU"
    host = (
        f"host {_gib(plan.host_peak_node)} of {_gib(hw.host_memory)} per node"
        if hw.host_memory
        else f"host {_gib(plan.host_peak_node)} per node"
    )
    if plan.fits:
        return f"FITS: {gpu}, {host}"
    short = [w for w, ok in (("GPU", plan.fits_gpu), ("host", plan.fits_host)) if not ok]
    fix = f"; first change: {plan.fix}" if plan.fix else "; no single flag change fits: add GPUs or nodes"
    return f"DOES NOT FIT ({' and '.join(short)} memory): {gpu}, {host}{fix}"


def table(plan: Any) -> str:
    st, t = plan.stats, plan.time
    lines = [
        f"{st.arch}: {st.num_params / 1e9:.3f}B parameters, V {st.vocab_size}, T {st.tokens_per_sample}, "
        f"{st.flops_per_token / 1e9:.2f} GFLOPs/token; {_layout(plan)} on {plan.hw.name}",
        f"{'per rank':<28}{'GPU':>12}{'host':>12}  note",
    ]
    for name, gpu, host, note in items_as_rows(list(plan.items)):
        lines.append(f"{name:<28}{gpu:>12}{host:>12}  {note}")
    lines.append(
        f"{'peak':<28}{_gib(plan.gpu_peak) if plan.hw.has_gpu else '-':>12}{_gib(plan.host_peak_rank):>12}"
        f"  x {plan.ranks_per_node} rank(s) per node = {_gib(plan.host_peak_node)} host; "
        f"at the {plan.update_peak.where}"
    )
    lines.append(
        f"FLOPs per step and rank: {t.flops_per_rank / 1e12:.1f} TFLOP ({t.tokens_per_step} tokens per update)"
    )
    for name, nbytes, secs in t.comm:
        lines.append(f"  {name}: {nbytes / GIB:.2f} GiB per rank, {secs * 1e3:.1f} ms")
    lines.append(
        f"step time: {t.total_s:.3f} s (compute {t.compute_s:.3f} s, optimizer {t.optimizer_s:.3f} s), "
        f"{t.tokens_per_step / t.total_s:,.0f} tokens/s, {t.tflops_per_gpu:.0f} TFLOP/s per GPU"
        + (f" ({t.tflops_per_gpu * 8 / 6:.0f} counting the recomputed forward)" if plan.setup.checkpoint else "")
    )
    lines.append(verdict(plan))
    return "\n".join(lines)


def summary(plan: Any) -> str:
    t = plan.time
    gpu = f"GPU {_gib(plan.gpu_peak)}, " if plan.hw.has_gpu else ""
    return (
        f"{plan.stats.num_params / 1e9:.2f}B params, {gpu}host {_gib(plan.host_peak_node)}/node, "
        f"step {t.total_s:.3f} s, {t.tokens_per_step / t.total_s:,.0f} tok/s, "
        f"{t.tflops_per_gpu:.0f} TFLOP/s/GPU on {plan.hw.name}: {verdict(plan)}"
    )


def summary_for_train(cfg: Any) -> str:
    """``toolkit-train --plan``: the plan's one line for this machine, world size from the environment."""
    import os

    from toolkit.plan.hardware import detect_hardware
    from toolkit.plan.planner import make_plan

    world = max(cfg.distributed.distributed_world_size, int(os.environ.get("WORLD_SIZE", "1") or 1))
    try:
        return "plan: " + summary(make_plan(cfg, detect_hardware(), world_size=world))
    except (AttributeError, TypeError, ValueError, RuntimeError) as e:  # a plugin model the planner cannot read
        return f"plan: not available for this model ({type(e).__name__}: {e}); training goes on"


def items_as_rows(items: List[Item]) -> List[Tuple[str, str, str, str]]:
    return [(i.name, _gib(i.gpu) if i.gpu else "-", _gib(i.host) if i.host else "-", i.note) for i in items]
