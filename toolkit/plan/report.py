"""How a plan reads: the per-rank table, the verdict with its reason, the layout search's fastest layouts that
fit with their flags, and the one-line summary ``toolkit-train --plan`` logs."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from toolkit.core.errors import UserError
from toolkit.plan.hardware import GIB
from toolkit.plan.memory import Item
from toolkit.plan.search import SearchResult


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _layout(plan: Any) -> str:
    s = plan.setup
    kind = f"fully_sharded {s.strategy}" if s.backend == "fully_sharded" else s.backend
    extra = (
        (f", TP {s.mp}" if s.mp > 1 else "")
        + (f", CP {s.cp}" if s.cp > 1 else "")
        + (f", EP {s.ep}" if s.ep > 1 else "")
        + (f", PP {s.pp} ({s.pp_schedule})" if s.pp > 1 else "")
        + (", cpu-offload" if s.cpu_offload else "")
        + (", checkpointed" if s.checkpoint else "")
    )
    return f"{s.world} rank(s), {kind}{extra}, {'bf16/fp16' if s.compute_bytes == 2 else 'fp32'}"


def verdict(plan: Any, found: Optional[SearchResult] = None) -> str:
    """FITS or DOES NOT FIT with both peaks; when it does not, the fastest layout the search found that fits
    (``found``), or that none of the layouts priced fits."""
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
    if found is None:
        change = ""
    elif found.shown:
        change = f"; fastest layout that fits: {' '.join(found.shown[0].flags)}"
    else:
        change = f"; none of the {found.priced:,} layouts searched fits: add GPUs or nodes"
    return f"DOES NOT FIT ({' and '.join(short)} memory): {gpu}, {host}{change}"


def layouts(plan: Any, found: SearchResult) -> str:
    """The fastest layouts that fit, one a line: step time, throughput, peaks, and the flags to add."""
    hw = plan.hw
    lines = [
        f"layout search (the same model, world and {plan.time.tokens_per_step:,} tokens per update): "
        f"{found.priced:,} layouts priced, {found.fitting:,} fit"
        + (f" ({found.refused} refused by toolkit-train's checks)" if found.refused else "")
        + ("; the fastest, with the flags to add to the command above:" if found.shown else "")
    ]
    if found.shown:
        lines.append(f"  {'step':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'GPU':>10} {'host/node':>11}  flags")
    for c in found.shown + ((found.pipelined,) if found.pipelined else ()):
        p = c.plan
        if c is found.pipelined:
            lines.append("  the fastest with pipeline stages:")
        lines.append(
            f"  {c.step_s:>7.3f} s {p.time.tokens_per_step / c.step_s:>10,.0f} {p.time.tflops_per_gpu:>8.0f} "
            f"{_gib(p.gpu_peak) if hw.has_gpu else '-':>10} {_gib(p.host_peak_node):>11}  "
            + (" ".join(c.flags) or "(as given)")
            + ("  [changes the numbers: lower-precision state or compute]" if c.lossy else "")
        )
    return "\n".join(lines)


def recurrent_state(plan: Any) -> str:
    """What one sequence's gated DeltaNet layers keep instead of keys and values: each layer's delta-rule state
    (value heads x key size x value size, in fp32, as the rule keeps it) and its convolution's last K-1 inputs (in
    the compute dtype), against the keys and values the model's full-attention layers would cache in their place
    at the run's length (the same T for every sequence: the state's bytes do not grow with T)."""
    st, cb = plan.stats, plan.setup.compute_bytes
    state, conv = 4 * st.recurrent_state, cb * st.recurrent_conv
    line = (
        f"recurrent state per sequence, {st.recurrent_layers} gated DeltaNet layers: {state + conv:,} B "
        f"({state:,} B of delta-rule states in fp32, {conv:,} B of convolution inputs at {cb} B a number)"
    )
    if st.attention_layers:
        kv = st.kv_width * st.recurrent_layers // st.attention_layers * st.tokens_per_sample * cb
        line += (
            f" against {kv:,} B of keys and values as full attention at T {st.tokens_per_sample} "
            f"({kv / (state + conv):.1f}x)"
        )
    return line


def pipeline_lines(plan: Any) -> List[str]:
    """Under ``--pipeline-parallel-size``: the schedule, its micro-batches and bubble, and each pp rank's layers,
    micro-batches in flight at its peak and peak (the table above is the fullest rank's)."""
    if not plan.stage_ranks:
        return []
    from toolkit.plan.pipeline import bubble_fraction, microbatch_sequences, microbatches

    s, where = plan.setup, "GPU" if plan.hw.has_gpu else "host"
    m = microbatches(s)
    lines = [
        f"pipeline: {s.pp} ranks along pp, {s.pp_schedule}, {m} micro-batches of {microbatch_sequences(s):g} "
        f"sequence(s), bubble {bubble_fraction(s.pp_schedule, s.pp, m):.1%}; the rows above are pp rank "
        f"{plan.fullest_stage.rank}'s, each rank's {where} peak:"
    ]
    for r in plan.stage_ranks:
        peak = r.gpu if plan.hw.has_gpu else r.host
        lines.append(f"  pp rank {r.rank}: {_gib(peak):>10}  {r.describe()}, {r.in_flight} micro-batch(es) in flight")
    return lines


def sparse_and_latent(plan: Any) -> List[str]:
    """The lines of a model that uses less than it holds: the parameters a token goes through (MoE), the KV
    cache a token costs in the compute dtype when its layers cache a latent (multi-head latent attention) against
    the expanded keys and values, and a sequence's recurrent state (gated DeltaNet layers) against keys and values."""
    st, lines = plan.stats, []
    if st.active_params is not None and st.active_params != st.num_params:
        lines.append(
            f"active parameters: {st.active_params:,} of {st.num_params:,} a token "
            f"({st.active_params / st.num_params:.1%}; the routed experts it is not sent to left out)"
        )
    if st.expanded_kv_width > st.kv_width:
        cb = plan.setup.compute_bytes
        lines.append(
            f"KV cache per token, all layers: {st.kv_width * cb:,} B latent against {st.expanded_kv_width * cb:,} B "
            f"of expanded keys and values ({st.expanded_kv_width / st.kv_width:.0f}x), at {cb} B a number"
        )
    if st.recurrent_layers:
        lines.append(recurrent_state(plan))
    return lines


def table(plan: Any, found: Optional[SearchResult] = None) -> str:
    st, t = plan.stats, plan.time
    lines = [
        f"{st.arch}: {st.num_params / 1e9:.3f}B parameters, V {st.vocab_size}, T {st.tokens_per_sample}, "
        f"{st.flops_per_token / 1e9:.2f} GFLOPs/token; {_layout(plan)} on {plan.hw.name}"
        + (
            f", host {_gib(plan.hw.host_memory)} per node ({plan.hw.host_memory_source})" if plan.hw.host_memory else ""
        ),
        f"{'per rank':<28}{'GPU':>12}{'host':>12}  note",
    ]
    for name, gpu, host, note in items_as_rows(list(plan.items)):
        lines.append(f"{name:<28}{gpu:>12}{host:>12}  {note}")
    lines.append(
        f"{'peak':<28}{_gib(plan.gpu_peak) if plan.hw.has_gpu else '-':>12}{_gib(plan.host_peak_rank):>12}"
        f"  x {plan.ranks_per_node} rank(s) per node = {_gib(plan.host_peak_node)} host; "
        f"at the {plan.update_peak.where}"
    )
    lines += pipeline_lines(plan)
    lines += sparse_and_latent(plan)
    lines.append(
        f"FLOPs per step and rank: {t.flops_per_rank / 1e12:.1f} TFLOP ({t.tokens_per_step} tokens per update)"
    )
    for name, nbytes, secs in t.comm:
        lines.append(f"  {name}: {nbytes / GIB:.2f} GiB per rank, {secs * 1e3:.1f} ms")
    lines.append(
        f"step time: {t.total_s:.3f} s (compute {t.compute_s:.3f} s, optimizer {t.optimizer_s:.3f} s), "
        f"{t.tokens_per_step / t.total_s:,.0f} tokens/s, {t.tflops_per_gpu:.0f} TFLOP/s per GPU"
        + (f" ({t.tflops_per_gpu * 8 / 6:.0f} counting the recomputed forward)" if plan.setup.checkpoint else "")
        + (f"; pipeline bubble {t.bubble:.1%} of it" if plan.setup.pp > 1 else "")
    )
    lines.append(verdict(plan, found))
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
        plan = make_plan(cfg, detect_hardware(), world_size=world)
    except UserError as e:  # e.g. a plugin optimizer that declares no state
        return f"plan: not available ({e}); training goes on"
    except (AttributeError, TypeError, ValueError, RuntimeError) as e:  # a plugin model the planner cannot read
        return f"plan: not available for this model ({type(e).__name__}: {e}); training goes on"
    line = "plan: " + summary(plan)
    return line if plan.fits else line + " (toolkit-plan with the same flags searches the layouts that fit)"


def items_as_rows(items: List[Item]) -> List[Tuple[str, str, str, str]]:
    return [(i.name, _gib(i.gpu) if i.gpu else "-", _gib(i.host) if i.host else "-", i.note) for i in items]
