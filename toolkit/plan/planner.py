"""Planning: a Plan from a config and hardware, and the search for the first flag change that fits."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from toolkit.plan.hardware import Hardware
from toolkit.plan.memory import Item, memory_items
from toolkit.plan.model_stats import ModelStats, model_stats
from toolkit.plan.setup import Setup, setup_from_config
from toolkit.plan.step_time import StepTime, step_time
from toolkit.plan.update_peak import Peak, update_peak


@dataclass(frozen=True)
class Plan:
    """A run's predicted memory and time. A peak is the persistent items (parameters, optimizer state,
    runtime) plus the update's peak (:mod:`toolkit.plan.update_peak`: what is alive at the same moment),
    not the sum of every row: gradients grow while saved activations shrink."""

    stats: ModelStats
    setup: Setup
    hw: Hardware
    items: Tuple[Item, ...]
    time: StepTime
    fix: Optional[str]  # the first flag change that makes it fit (None: fits, or nothing found)

    @property
    def update_peak(self) -> Peak:
        return update_peak(self.stats, self.setup, self.hw)

    @property
    def gpu_peak(self) -> int:
        return sum(i.gpu for i in self.items if i.persistent) + self.update_peak.gpu

    @property
    def host_peak_rank(self) -> int:
        return sum(i.host for i in self.items if i.persistent) + self.update_peak.host

    @property
    def ranks_per_node(self) -> int:
        return min(self.hw.gpus_per_node, self.setup.world) if self.hw.has_gpu else 1

    @property
    def host_peak_node(self) -> int:
        return self.host_peak_rank * self.ranks_per_node

    @property
    def fits_gpu(self) -> bool:
        return not self.hw.has_gpu or self.gpu_peak <= self.hw.gpu_memory

    @property
    def fits_host(self) -> bool:
        return self.hw.host_memory <= 0 or self.host_peak_node <= self.hw.host_memory

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host


def plan_for(stats: ModelStats, setup: Setup, hw: Hardware) -> Tuple[Tuple[Item, ...], StepTime]:
    return tuple(memory_items(stats, setup, hw)), step_time(stats, setup, hw)


def make_plan(cfg: Any, hw: Hardware, vocab_size: Optional[int] = None, world_size: Optional[int] = None) -> Plan:
    """The plan of ``cfg`` (a resolved TrainConfig) on ``hw``; ``world_size`` overrides the config's."""
    setup = setup_from_config(cfg, hw.has_gpu)
    if world_size:
        setup = dataclasses.replace(setup, world=world_size)
    setup.layout(hw.gpus_per_node)  # refuses what toolkit-train refuses (--model-parallel-size 3 of 8 ranks)
    stats = model_stats(cfg, setup.compute_dtype, vocab_size)
    items, time = plan_for(stats, setup, hw)
    plan = Plan(stats, setup, hw, items, time, None)
    return plan if plan.fits else dataclasses.replace(plan, fix=first_fix(plan))


# Tried in this order: cheapest first (no extra hardware, least speed lost).
_GPU_FIXES = (
    ("--checkpoint-activations", lambda s: not s.checkpoint, dict(checkpoint=True)),
    (
        "--ddp-backend fully_sharded",
        lambda s: not s.fsdp and s.world > 1,
        dict(fsdp=True, backend="fully_sharded", strategy="full_shard", reshard=True),
    ),
    (
        "--sharding-strategy full_shard",
        lambda s: s.fsdp and s.strategy != "full_shard" and s.dp > 1,
        dict(strategy="full_shard", reshard=True),
    ),
)
# Offloading slows every step down (host Adam, PCIe copies): after a smaller micro-batch.
_OFFLOAD_FIX = (
    (
        "--ddp-backend fully_sharded --cpu-offload",
        lambda s: not s.cpu_offload and s.mp == 1,
        dict(cpu_offload=True, optimizer="cpu_adam", fsdp=True, backend="fully_sharded", strategy=None, reshard=True),
    ),
)
_HOST_FIXES = (
    (
        "--adam-state-precision 8bit",
        lambda s: s.optimizer == "cpu_adam" and s.adam_state_precision != "8bit",
        dict(adam_state_precision="8bit"),
    ),
    ("--bf16-host-grads", lambda s: s.cpu_offload and not s.bf16_host_grads, dict(bf16_host_grads=True)),
)


def _apply(s: Setup, fixes: Any) -> List[Tuple[str, Setup]]:
    """The fixes that apply to ``s``, each as (flags, the setup with it); None in a change keeps the strategy."""
    out = []
    for flag, applies, change in fixes:
        if applies(s):
            change = {k: (s.strategy if s.fsdp else "full_shard") if v is None else v for k, v in change.items()}
            out.append((flag, dataclasses.replace(s, **change)))
    return out


def _candidates(plan: Any) -> List[Tuple[str, Setup]]:
    """Single flag changes for what does not fit: GPU memory first, then host memory."""
    s = plan.setup
    out = _apply(s, (_GPU_FIXES if not plan.fits_gpu else ()) + (_HOST_FIXES if not plan.fits_host else ()))
    if not plan.fits_gpu and s.mp == 1 and not s.cpu_offload:
        for m in (2, 4, 8):  # Megatron's split within a node: a block's gathered weights and grads / m
            if m <= plan.hw.gpus_per_node and s.world % m == 0 and s.world > m:
                out.append((f"--model-parallel-size {m}", dataclasses.replace(s, mp=m, fsdp=s.backend != "no_c10d")))
    return out


def _smaller_batches(s: Setup) -> List[Tuple[str, Setup]]:
    """Half the micro-batch (and twice --update-freq: the same tokens per update), then a quarter, ..."""
    out, b, freq = [], s.batch_sequences, s.update_freq
    while b > 1:
        b, freq = b // 2, freq * 2
        out.append(
            (f"--batch-size {b} --update-freq {freq}", dataclasses.replace(s, batch_sequences=b, update_freq=freq))
        )
    return out


def first_fix(plan: Plan) -> Optional[str]:
    """The first change after which the plan fits: one flag, then a smaller micro-batch, then --cpu-offload,
    then any of those with --checkpoint-activations added (cheapest first: no extra hardware, least speed lost)."""
    single = _candidates(plan)
    tried = single + _smaller_batches(plan.setup) + (_apply(plan.setup, _OFFLOAD_FIX) if not plan.fits_gpu else [])
    if not plan.setup.checkpoint:
        tried += [
            (f"--checkpoint-activations {flag}", dataclasses.replace(s, checkpoint=True))
            for flag, s in tried
            if not flag.startswith("--checkpoint")
        ]
    for flag, setup in tried:
        items, time = plan_for(plan.stats, setup, plan.hw)
        if Plan(plan.stats, setup, plan.hw, items, time, None).fits:
            return flag
    return None
