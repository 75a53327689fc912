"""``toolkit.plan``: per-rank memory and step time of a training run, before renting the machines.

    from toolkit.plan import make_plan, PRESETS
    plan = make_plan(train_config, PRESETS["h100"])
    print(plan.table()); print(plan.summary())

Takes the resolved :class:`~toolkit.config.TrainConfig` of the same flags ``toolkit-train`` takes,
so a plan and the run it predicts cannot disagree about what was asked. The model's own parameter
shapes, FLOPs per token and saved activations come from a meta-device build
(:mod:`toolkit.plan.model_stats`); bytes per item from :mod:`toolkit.plan.memory`; the step time
from :mod:`toolkit.plan.step_time`. ``benchmarks/plan_check.py`` compares the predictions with
measured runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from toolkit.plan.hardware import GIB, PRESETS, Hardware, detect_hardware
from toolkit.plan.memory import Item, memory_items
from toolkit.plan.model_stats import ModelStats, model_stats
from toolkit.plan.setup import Setup, setup_from_config
from toolkit.plan.step_time import StepTime, step_time

__all__ = ["Plan", "make_plan", "plan_for", "PRESETS", "Hardware", "detect_hardware", "summary_for_train"]


@dataclass(frozen=True)
class Plan:
    stats: ModelStats
    setup: Setup
    hw: Hardware
    items: Tuple[Item, ...]
    time: StepTime
    fix: Optional[str]  # the first flag change that makes it fit (None: fits, or nothing found)

    @property
    def gpu_peak(self) -> int:
        return sum(i.gpu for i in self.items)

    @property
    def host_peak_rank(self) -> int:
        return sum(i.host for i in self.items)

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

    def verdict(self) -> str:
        from toolkit.plan.report import verdict

        return verdict(self)

    def table(self) -> str:
        from toolkit.plan.report import table

        return table(self)

    def summary(self) -> str:
        from toolkit.plan.report import summary

        return summary(self)


def plan_for(stats: ModelStats, setup: Setup, hw: Hardware) -> Tuple[Tuple[Item, ...], StepTime]:
    return tuple(memory_items(stats, setup, hw)), step_time(stats, setup, hw)


def make_plan(cfg: Any, hw: Hardware, vocab_size: Optional[int] = None, world_size: Optional[int] = None) -> Plan:
    """The plan of ``cfg`` (a resolved TrainConfig) on ``hw``; ``world_size`` overrides the config's."""
    import dataclasses

    from toolkit.plan.report import first_fix

    setup = setup_from_config(cfg, hw.has_gpu)
    if world_size:
        setup = dataclasses.replace(setup, world=world_size)
    stats = model_stats(cfg, setup.compute_dtype, vocab_size)
    items, time = plan_for(stats, setup, hw)
    plan = Plan(stats, setup, hw, items, time, None)
    return plan if plan.fits else dataclasses.replace(plan, fix=first_fix(plan))


def summary_for_train(cfg: Any) -> str:
    """``toolkit-train --plan``: the plan's one line for this machine, world size from the environment."""
    import os

    world = max(cfg.distributed.distributed_world_size, int(os.environ.get("WORLD_SIZE", "1") or 1))
    return "plan: " + make_plan(cfg, detect_hardware(), world_size=world).summary()


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def items_as_rows(items: List[Item]) -> List[Tuple[str, str, str, str]]:
    return [(i.name, _gib(i.gpu) if i.gpu else "-", _gib(i.host) if i.host else "-", i.note) for i in items]
