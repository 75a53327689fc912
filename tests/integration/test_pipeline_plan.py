"""toolkit-plan's pipeline stages against measured CPU ranks: every schedule's two stages on 2 forked gloo ranks
(``benchmarks/pipeline_schedules.py``'s 4-layer Llama, 8 rows of 128 tokens), each stage's parameters plus the
live-tensor peak of one step (the profiler's allocation events) within 15% of the planner's rows for that pp rank
(parameters, gradients, the activations of the micro-batches in flight, the backward transient); and the micro-batches
each schedule keeps in flight, read from torch's own action order, against the published counts."""

from __future__ import annotations

import pytest
import torch

from benchmarks import pipeline_schedules as bench
from tests.helpers.tp_helpers import spawn
from toolkit.plan.pipeline import bubble_fraction, in_flight


def worker_measure(rank: int, world_size: int, out_dir: str) -> list:
    import torch.distributed as dist

    mine = bench.measure_rank(rank, world_size, bench.SCHEDULES, steps=0)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, [(m["params"], m["live_peak"]) for m in mine])
    return everyone


def test_planned_stage_memory_is_within_15_percent_of_measured(tmp_path):
    spawn(worker_measure, 2, str(tmp_path))
    ranks = torch.load(tmp_path / "result.pt", weights_only=True)
    for i, schedule in enumerate(bench.SCHEDULES):
        planned = bench.planned(schedule)["stages"]
        for stage, measured in enumerate(params + peak for params, peak in (r[i] for r in ranks)):
            assert abs(planned[stage] / measured - 1) <= 0.15, (schedule, stage, planned[stage], measured)


@pytest.mark.parametrize("pp", [2, 4])
def test_in_flight_matches_the_published_counts(pp):
    def peaks(schedule, m):
        return [max(sum(state[: len(state) // 2]) for state in rank) for rank in in_flight(schedule, pp, m)]

    m = 4 * pp
    assert peaks("gpipe", m) == [m] * pp
    assert peaks("1f1b", m) == [pp - r for r in range(pp)]
    # Megatron's interleaved warmup, (V-1)P + 2(P-1-r) forwards of half a rank's layers, and one more
    assert peaks("interleaved_1f1b", m) == [pp + 2 * (pp - 1 - r) + 1 for r in range(pp)]
    assert peaks("zero_bubble", m) == [2 * pp] * pp  # ZB-H1: 1F1B's memory (P micro-batches of the whole rank)
    assert peaks("dualpipev", m) == [2 * pp + 1] * pp  # DualPipe: PP + 1 of its chunks
    assert bubble_fraction("1f1b", pp, m) == pytest.approx((pp - 1) / (m + pp - 1))
    assert bubble_fraction("interleaved_1f1b", pp, m) == pytest.approx((pp - 1) / (2 * m + pp - 1))
