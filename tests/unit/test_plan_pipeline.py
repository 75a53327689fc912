"""The planner's pipeline arithmetic, in-process: the cost-balanced default split and a tiny pp 2 plan's stages (the
micro-batches the multi-stage schedules keep in flight: tests/integration/test_pipeline_plan.py, beside the run that
imports torch's pipelining)."""

from __future__ import annotations

import pytest

from toolkit.core.errors import UserError
from toolkit.distributed.pipeline import layer_costs, layer_counts


@pytest.mark.parametrize(
    "costs, stages, want",
    [
        ([11, 10, 10, 11], 2, [2, 2]),
        ([3, 1, 1, 1, 1, 1, 1, 3], 4, [1, 3, 3, 1]),  # heavy ends (embeddings, head): fewer layers there
        ([1.65] + [1] * 124 + [1.65], 16, [7] + [8] * 14 + [7]),  # llama3_405b's 126 layers, 16 stages
    ],
)
def test_default_split_balances_costs(costs, stages, want):
    assert layer_counts(len(costs), stages, None, costs) == want
    assert (
        layer_counts(len(costs), stages, ",".join(["1"] * (stages - 1) + [str(len(costs) - stages + 1)]), costs)[0] == 1
    )  # --pipeline-balance wins
    with pytest.raises(UserError, match="--pipeline-balance"):
        layer_counts(len(costs), stages, "1,1", costs)


def test_layer_costs_count_embeddings_first_and_head_last():
    named = [("embed_tokens.weight", 50), ("layers.0.w", 10), ("layers.1.w", 10), ("norm.weight", 1)]
    named.append(("output_projection.weight", 50))
    assert layer_costs(named, 2) == [60, 61]


def test_tiny_pipeline_plan_splits_the_model_over_its_stages():
    from benchmarks.pipeline_schedules import VOCAB, config
    from toolkit.plan.hardware import PRESETS
    from toolkit.plan.planner import make_plan

    plan = make_plan(config("1f1b"), PRESETS["cpu"], vocab_size=VOCAB)
    first, last = plan.stage_ranks
    assert (first.first, first.last, last.first, last.last) == (True, False, False, True)
    assert (first.in_flight, last.in_flight) == (2, 1)
    held = [sum(i.host for i in r.items if i.name.startswith("parameters")) for r in plan.stage_ranks]
    assert sum(held) == 4 * plan.stats.num_params
    assert plan.time.bubble == pytest.approx(1 / 3)  # 2 micro-batches over 2 stages
    assert plan.host_peak_rank == max(r.host for r in plan.stage_ranks)
