"""How a plan reads: the per-rank table, the verdict with its reason, the one-line summary, and the
first flag to change when it does not fit (found by planning the candidates, not by a rule of thumb)."""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Tuple

from toolkit.plan.hardware import GIB

# Tried in this order: cheapest first (no extra hardware, least speed lost).
_GPU_FIXES = (
    ("--checkpoint-activations", lambda s: not s.checkpoint, dict(checkpoint=True)),
    ("--ddp-backend fully_sharded", lambda s: not s.fsdp and s.world > 1,
     dict(fsdp=True, backend="fully_sharded", strategy="full_shard", reshard=True)),
    ("--sharding-strategy full_shard", lambda s: s.fsdp and s.strategy != "full_shard" and s.dp > 1,
     dict(strategy="full_shard", reshard=True)),
    ("--cpu-offload", lambda s: not s.cpu_offload and s.mp == 1,
     dict(cpu_offload=True, optimizer="cpu_adam", fsdp=True, backend="fully_sharded",
          strategy=None, reshard=True)),
)
_HOST_FIXES = (
    ("--adam-state-precision 8bit", lambda s: s.optimizer == "cpu_adam" and s.adam_state_precision != "8bit",
     dict(adam_state_precision="8bit")),
    ("--bf16-host-grads", lambda s: s.cpu_offload and not s.bf16_host_grads, dict(bf16_host_grads=True)),
)


def _candidates(plan: Any) -> List[Tuple[str, Any]]:
    s = plan.setup
    out = []
    fixes = (_GPU_FIXES if not plan.fits_gpu else ()) + (_HOST_FIXES if not plan.fits_host else ())
    for flag, applies, change in fixes:
        if applies(s):
            change = {k: (s.strategy if s.fsdp else "full_shard") if v is None else v for k, v in change.items()}
            out.append((flag, dataclasses.replace(s, **change)))
    if s.batch_sequences > 1:
        half = s.batch_sequences // 2
        out.append((f"--batch-size {half} --update-freq {s.update_freq * 2}",
                    dataclasses.replace(s, batch_sequences=half, update_freq=s.update_freq * 2)))
    return out


def first_fix(plan: Any) -> Optional[str]:
    """The first single change (then the same with --checkpoint-activations) after which the plan fits."""
    from toolkit.plan import Plan, plan_for

    tried = _candidates(plan)
    if not plan.setup.checkpoint:
        tried += [(f"--checkpoint-activations {flag}", dataclasses.replace(s, checkpoint=True))
                  for flag, s in tried if not flag.startswith("--checkpoint")]
    for flag, setup in tried:
        items, time = plan_for(plan.stats, setup, plan.hw)
        if Plan(plan.stats, setup, plan.hw, items, time, None).fits:
            return flag
    return None


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _layout(plan: Any) -> str:
    s = plan.setup
    kind = (f"fully_sharded {s.strategy}" if s.backend == "fully_sharded" else s.backend)
    extra = (f", TP {s.mp}" if s.mp > 1 else "") + (", cpu-offload" if s.cpu_offload else "") + \
            (", checkpointed" if s.checkpoint else "")
    return f"{s.world} rank(s), {kind}{extra}, {'bf16/fp16' if s.compute_bytes == 2 else 'fp32'}"


def verdict(plan: Any) -> str:
    hw = plan.hw
    gpu = (f"GPU {_gib(plan.gpu_peak)} of {_gib(hw.gpu_memory)}" if hw.has_gpu else "no GPU")
    host = f"host {_gib(plan.host_peak_node)} of {_gib(hw.host_memory)} per node" if hw.host_memory else \
        f"host {_gib(plan.host_peak_node)} per node"
    if plan.fits:
        return f"FITS: {gpu}, {host}"
    short = [w for w, ok in (("GPU", plan.fits_gpu), ("host", plan.fits_host)) if not ok]
    fix = f"; first change: {plan.fix}" if plan.fix else "; no single flag change fits: add GPUs or nodes"
    return f"DOES NOT FIT ({' and '.join(short)} memory): {gpu}, {host}{fix}"


def table(plan: Any) -> str:
    from toolkit.plan import items_as_rows

    st, t = plan.stats, plan.time
    lines = [f"{st.arch}: {st.num_params / 1e9:.3f}B parameters, V {st.vocab_size}, T {st.tokens_per_sample}, "
             f"{st.flops_per_token / 1e9:.2f} GFLOPs/token; {_layout(plan)} on {plan.hw.name}",
             f"{'per rank':<28}{'GPU':>12}{'host':>12}  note"]
    for name, gpu, host, note in items_as_rows(list(plan.items)):
        lines.append(f"{name:<28}{gpu:>12}{host:>12}  {note}")
    lines.append(f"{'peak':<28}{_gib(plan.gpu_peak) if plan.hw.has_gpu else '-':>12}{_gib(plan.host_peak_rank):>12}"
                 f"  x {plan.ranks_per_node} rank(s) per node = {_gib(plan.host_peak_node)} host")
    lines.append(f"FLOPs per step and rank: {t.flops_per_rank / 1e12:.1f} TFLOP ({t.tokens_per_step} tokens per update)")
    for name, nbytes, secs in t.comm:
        lines.append(f"  {name}: {nbytes / GIB:.2f} GiB per rank, {secs * 1e3:.1f} ms")
    lines.append(f"step time: {t.total_s:.3f} s (compute {t.compute_s:.3f} s, optimizer {t.optimizer_s:.3f} s), "
                 f"{t.tokens_per_step / t.total_s:,.0f} tokens/s, {t.tflops_per_gpu:.0f} TFLOP/s per GPU")
    lines.append(plan.verdict())
    return "\n".join(lines)


def summary(plan: Any) -> str:
    t = plan.time
    gpu = f"GPU {_gib(plan.gpu_peak)}, " if plan.hw.has_gpu else ""
    return (f"{plan.stats.num_params / 1e9:.2f}B params, {gpu}host {_gib(plan.host_peak_node)}/node, "
            f"step {t.total_s:.3f} s, {t.tokens_per_step / t.total_s:,.0f} tok/s, "
            f"{t.tflops_per_gpu:.0f} TFLOP/s/GPU on {plan.hw.name}: {plan.verdict()}")
