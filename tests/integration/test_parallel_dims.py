"""The parallel layout (toolkit.distributed.parallel_dims.ParallelDims) on 4 gloo ranks: every sub-mesh and group
a consumer asks for has the ranks the layout table says, and a collective over it reaches exactly those ranks.

Rank r of 4 sits at (dp_replicate, dp_shard, cp, tp) with tp innermost; the expected groups below are written
out by hand from that order (not computed by the code under test). Training through these layouts against one
process is tests/integration/test_distributed.py (FSDP2 / HSDP) and test_tensor_parallel.py (TP, TP x HSDP).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import layout_helpers, tp_helpers

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not available")

ALL = [0, 1, 2, 3]
PAIRS_TP = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}  # consecutive ranks
PAIRS_DP = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}  # same tp rank


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("layouts"))
    tp_helpers.spawn(layout_helpers.worker_layouts, 4, out)
    return torch.load(os.path.join(out, "result.pt"), weights_only=True)


def _each_rank(ranks, key):
    return [r[key] for r in ranks]


def test_data_parallel_only(layouts):
    for name, mesh in (
        ("full_shard", ((4,), ("dp_shard",))),
        ("hybrid_2x2", ((2, 2), ("dp_replicate", "dp_shard"))),
        ("c10d", None),
    ):
        ranks = layouts[name]
        assert _each_rank(ranks, "data") == [(r, 4) for r in ALL], name
        assert _each_rank(ranks, "loss_ranks") == [ALL] * 4 and _each_rank(ranks, "loss_sum") == [6] * 4, name
        assert _each_rank(ranks, "mesh") == [mesh] * 4, name
        if mesh is not None:
            assert _each_rank(ranks, "fsdp") == [mesh] * 4, name  # FSDP2's mesh is the whole data-parallel mesh


def test_tensor_parallel_replicated(layouts):
    """c10d under TP: FSDP2 replicates on (dp_replicate 2, dp_shard 1); the TP pair reads one batch."""
    ranks = layouts["c10d_tp2"]
    assert _each_rank(ranks, "data") == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert _each_rank(ranks, "loss_ranks") == [PAIRS_DP[r] for r in ALL]
    assert _each_rank(ranks, "loss_sum") == [sum(PAIRS_DP[r]) for r in ALL]
    assert _each_rank(ranks, "mesh") == [((2, 1, 2), ("dp_replicate", "dp_shard", "tp"))] * 4
    assert _each_rank(ranks, "fsdp") == [((2, 1), ("dp_replicate", "dp_shard"))] * 4
    assert _each_rank(ranks, "tp") == [(PAIRS_TP[r], sum(PAIRS_TP[r])) for r in ALL]


def test_tensor_and_expert_parallel(layouts):
    """dp_shard 2 x tp 2, ep 2 carved from dp_shard: the experts' ranks are the data-parallel peers."""
    ranks = layouts["full_shard_tp2_ep2"]
    assert _each_rank(ranks, "data") == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert _each_rank(ranks, "mesh") == [((2, 2), ("dp_shard", "tp"))] * 4
    assert _each_rank(ranks, "fsdp") == [((2,), ("dp_shard",))] * 4
    assert _each_rank(ranks, "loss_ranks") == [PAIRS_DP[r] for r in ALL]
    assert _each_rank(ranks, "tp") == [(PAIRS_TP[r], sum(PAIRS_TP[r])) for r in ALL]
    assert _each_rank(ranks, "ep") == [(PAIRS_DP[r], sum(PAIRS_DP[r])) for r in ALL]
    # each expert whole on both tp ranks: FSDP2 shards it over the TP pair holding it
    assert _each_rank(ranks, "expert_holders") == [(PAIRS_TP[r], sum(PAIRS_TP[r])) for r in ALL]


def test_expert_parallel_carved_from_the_replicas_under_tensor_parallelism(layouts):
    """c10d under TP (FSDP2 replicate on (2, 1)): ep 2 spreads the experts over the 2 data-parallel replicas."""
    ranks = layouts["c10d_tp2_ep2"]
    assert _each_rank(ranks, "fsdp") == [((2, 1), ("dp_replicate", "dp_shard"))] * 4
    assert _each_rank(ranks, "ep") == [(PAIRS_DP[r], sum(PAIRS_DP[r])) for r in ALL]
    assert _each_rank(ranks, "expert_holders") == [(PAIRS_TP[r], sum(PAIRS_TP[r])) for r in ALL]


def test_context_and_expert_parallel(layouts):
    """dp_shard 2 x cp 2: the CP pair reads one batch, FSDP2 shards over dp_shard x cp, losses sum over all 4."""
    ranks = layouts["full_shard_cp2_ep4"]
    assert _each_rank(ranks, "data") == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert _each_rank(ranks, "loss_world") == [4] * 4 and _each_rank(ranks, "loss_ranks") == [ALL] * 4
    assert _each_rank(ranks, "mesh") == [((4,), ("dp_shard_cp",))] * 4
    assert _each_rank(ranks, "cp") == [(PAIRS_TP[r], sum(PAIRS_TP[r])) for r in ALL]
    assert _each_rank(ranks, "ep") == [(ALL, 6)] * 4
    assert _each_rank(ranks, "expert_fsdp") == [([r], r) for r in ALL]  # each rank alone holds its experts


def test_experts_sharded_by_fsdp2_over_the_ranks_holding_them(layouts):
    """full_shard x ep 2 on 4 ranks: the dense layers shard over all 4, ep pairs are consecutive data-parallel ranks,
    and each rank's experts are sharded over the ranks with the same ep index (torchtitan's dp_shard_mod_ep)."""
    ranks = layouts["full_shard_ep2"]
    assert _each_rank(ranks, "fsdp") == [((4,), ("dp_shard",))] * 4
    assert _each_rank(ranks, "ep") == [(PAIRS_TP[r], sum(PAIRS_TP[r])) for r in ALL]
    assert _each_rank(ranks, "expert_fsdp") == [(PAIRS_DP[r], sum(PAIRS_DP[r])) for r in ALL]
    assert _each_rank(ranks, "expert_peers") == [(PAIRS_DP[r], sum(PAIRS_DP[r])) for r in ALL]


@pytest.mark.parametrize(
    "name,dense",
    [
        ("hybrid_2x2_ep2", ((2, 2), ("dp_replicate", "dp_shard"))),
        ("no_shard_ep2", ((4, 1), ("dp_replicate", "dp_shard"))),
    ],
)
def test_experts_under_hsdp_replicate_across_the_groups(layouts, name, dense):
    """hybrid_shard (2 groups of 2) and no_shard x ep 2: the dense layers keep their (replicate, shard) mesh, ep pairs
    are consecutive ranks, and the experts get a (replicate, shard) mesh of their own over the ranks holding the same
    ones (torchtitan's dp_mod_ep): here each expert whole on its rank (shard 1), replicated over the other pair."""
    ranks = layouts[name]
    assert _each_rank(ranks, "fsdp") == [dense] * 4
    assert _each_rank(ranks, "ep") == [(PAIRS_TP[r], sum(PAIRS_TP[r])) for r in ALL]
    assert _each_rank(ranks, "expert_fsdp") == [
        ((2, 1), ("ep_replicate", "ep_shard"), [(PAIRS_DP[r], sum(PAIRS_DP[r])), ([r], r)]) for r in ALL
    ]
    assert _each_rank(ranks, "expert_peers") == [(PAIRS_DP[r], sum(PAIRS_DP[r])) for r in ALL]  # both axes flattened
