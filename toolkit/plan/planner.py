"""Planning: a Plan from a config and hardware (the search for layouts that fit is :mod:`toolkit.plan.search`)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from toolkit.core.errors import UserError
from toolkit.distributed.context_parallel import check_sequence_split
from toolkit.plan.hardware import Hardware
from toolkit.plan.memory import Item, memory_items, optimizer_state
from toolkit.plan.model_stats import ModelStats, model_stats
from toolkit.plan.pipeline import StageRank, check_pipeline, stage_ranks
from toolkit.plan.setup import Setup, setup_from_config
from toolkit.plan.step_time import StepTime, step_time
from toolkit.plan.update_peak import Peak, update_peak


@dataclass(frozen=True)
class Plan:
    """A run's predicted memory and time (each computed at its first use: the layout search asks most plans
    only whether they fit). A peak is the persistent items (parameters, optimizer state,
    runtime) plus the update's peak (:mod:`toolkit.plan.update_peak`: what is alive at the same moment),
    not the sum of every row: gradients grow while saved activations shrink."""

    stats: ModelStats
    setup: Setup
    hw: Hardware

    @functools.cached_property
    def stage_ranks(self) -> Tuple[StageRank, ...]:
        """Under ``--pipeline-parallel-size``: every pp rank's rows (:mod:`toolkit.plan.pipeline`); else none."""
        return stage_ranks(self.stats, self.setup, self.hw) if self.setup.pp > 1 else ()

    @property
    def fullest_stage(self) -> StageRank:
        """The pp rank whose peak is highest (GPU memory, or host memory without a GPU): the one that decides."""
        return max(self.stage_ranks, key=lambda r: r.gpu if self.hw.has_gpu else r.host)

    @functools.cached_property
    def items(self) -> Tuple[Item, ...]:
        if self.stage_ranks:
            return self.fullest_stage.items
        return tuple(memory_items(self.stats, self.setup, self.hw))

    @functools.cached_property
    def time(self) -> StepTime:
        return step_time(self.stats, self.setup, self.hw)

    @functools.cached_property
    def update_peak(self) -> Peak:
        if self.stage_ranks:  # a pipeline rank's rows all live at its peak (the micro-batches most in flight)
            rank, items = self.fullest_stage, [i for i in self.fullest_stage.items if not i.persistent]
            where = f"pp rank {rank.rank}'s peak, {rank.in_flight} micro-batch(es) in flight"
            return Peak(sum(i.gpu for i in items), sum(i.host for i in items), where)
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


def make_plan(cfg: Any, hw: Hardware, vocab_size: Optional[int] = None, world_size: Optional[int] = None) -> Plan:
    """The plan of ``cfg`` (a resolved TrainConfig) on ``hw``; ``world_size`` overrides the config's."""
    setup = setup_from_config(cfg, hw.has_gpu)
    if world_size:
        setup = dataclasses.replace(setup, world=world_size)
    setup.layout(hw.gpus_per_node)  # refuses what toolkit-train refuses (--model-parallel-size 3 of 8 ranks)
    optimizer_state(setup.optimizer)  # an optimizer that declares no state is refused before the model is built
    check_sequence_split(setup.cp, cfg.task, cfg.model)  # samples that do not cut into 2 x cp chunks, likewise
    stats = model_stats(cfg, setup.compute_dtype, vocab_size)
    check_model_splits(setup, stats)
    check_pipeline(stats, setup)
    return Plan(stats, setup, hw)


def check_model_splits(setup: Setup, stats: ModelStats) -> None:
    """Refuse the tensor-parallel sizes the model cannot be split into (what toolkit-train's workers refuse, or
    fail on), in one line naming the flag: a plan of them would say FITS for a run that cannot start. (Context
    parallelism's sequence split is toolkit-train's own check, ``context_parallel.check_sequence_split``.)"""
    splits, M = stats.splits, setup.mp
    if M > 1 and splits.tp_refused is not None:
        raise UserError(splits.tp_refused)
    for flag, value in splits.tp_divisible if M > 1 else ():
        if value % M:
            raise UserError(
                f"{flag} {value}: must be divisible by --model-parallel-size {M} (each rank holds whole heads and "
                f"an equal share); choose a model parallel size that divides it"
            )
