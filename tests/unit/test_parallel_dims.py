"""The parallel layout's pure validation (toolkit.distributed.parallel_dims.parallel_shape): sizes -> shape or a
one-line error naming the axis; the same refusals from toolkit-train's resolve and toolkit-plan's planner.

The meshes themselves are built on 4 gloo ranks in tests/integration/test_parallel_dims.py.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from toolkit.config import DistributedConfig
from toolkit.core.errors import UserError
from toolkit.distributed.parallel_dims import ParallelDims, ParallelShape, parallel_shape, shape_from_config


def sizes(s: ParallelShape):
    return (s.dp_replicate, s.dp_shard, s.cp, s.tp, s.ep)


@pytest.mark.parametrize(
    "kwargs,want,fsdp,hsdp",
    [
        (dict(world=8), (8, 1, 1, 1, 1), False, False),  # DDP: replicas
        (dict(world=8, ddp_backend="legacy_ddp"), (8, 1, 1, 1, 1), False, False),
        (dict(world=8, ddp_backend="fully_sharded"), (1, 8, 1, 1, 1), True, False),
        (dict(world=8, ddp_backend="fully_sharded", sharding_strategy="shard_grad_op"), (1, 8, 1, 1, 1), True, False),
        (dict(world=8, ddp_backend="fully_sharded", sharding_strategy="no_shard"), (8, 1, 1, 1, 1), True, True),
        # hybrid: the default group is the ranks of one machine; --shard-group-size overrides it
        (
            dict(world=16, ddp_backend="fully_sharded", sharding_strategy="hybrid_shard", local_world_size=8),
            (2, 8, 1, 1, 1),
            True,
            True,
        ),
        (
            dict(world=16, ddp_backend="fully_sharded", sharding_strategy="hybrid_shard_zero2", shard_group_size=4),
            (4, 4, 1, 1, 1),
            True,
            True,
        ),
        (dict(world=8, ddp_backend="fully_sharded", sharding_strategy="hybrid_shard"), (1, 8, 1, 1, 1), True, True),
        # tensor parallel: FSDP2 under any backend; c10d replicates (no_shard's shape); hybrid groups per machine / M
        (dict(world=8, tp=2), (4, 1, 1, 2, 1), True, True),
        (dict(world=8, ddp_backend="fully_sharded", tp=4), (1, 2, 1, 4, 1), True, False),
        (
            dict(world=16, ddp_backend="fully_sharded", sharding_strategy="hybrid_shard", local_world_size=8, tp=2),
            (2, 4, 1, 2, 1),
            True,
            True,
        ),  # a machine of 8 holds 4 TP pairs: they shard, 2 machines replicate
        # tp x dp x cp x ep: ep carved from dp_shard x cp
        (dict(world=16, ddp_backend="fully_sharded", tp=2, cp=2), (1, 4, 2, 2, 1), True, False),
        (dict(world=16, ddp_backend="fully_sharded", tp=2, cp=2, ep=8), (1, 4, 2, 2, 8), True, False),
        (
            dict(
                world=32,
                ddp_backend="fully_sharded",
                sharding_strategy="hybrid_shard",
                shard_group_size=2,
                tp=2,
                cp=2,
                ep=4,
            ),
            (4, 2, 2, 2, 4),
            True,
            True,
        ),
        # c10d under TP: FSDP2 replicates over the world / tp data-parallel ranks, and ep is carved from those
        (dict(world=4, tp=2, ep=2), (2, 1, 1, 2, 2), True, True),
    ],
)
def test_shapes(kwargs, want, fsdp, hsdp):
    shape = parallel_shape(**kwargs)
    assert sizes(shape) == want and (shape.fsdp, shape.hsdp) == (fsdp, hsdp)
    assert shape.dp_replicate * shape.dp_shard * shape.cp * shape.tp == shape.world


def test_ranks_data_loss_and_coordinates():
    """Data is sharded over dp_replicate x dp_shard; CP and TP ranks of one replica read the same batch."""
    shape = parallel_shape(16, "fully_sharded", "hybrid_shard", shard_group_size=2, tp=2, cp=2, ep=4)
    assert sizes(shape) == (2, 2, 2, 2, 4)
    assert shape.data_world == 4 and shape.loss_world == 8 and shape.fsdp_shard == 4
    assert [shape.data_rank(r) for r in range(16)] == [r // 4 for r in range(16)]
    assert shape.coordinates(13) == dict(pp=0, dp_replicate=1, dp_shard=1, cp=0, tp=1, ep=2)  # ((1*2+1)*2+0)*2+1
    assert shape.coordinates(7) == dict(pp=0, dp_replicate=0, dp_shard=1, cp=1, tp=1, ep=3)
    staged = parallel_shape(8, "fully_sharded", pp=2)  # pp outermost: ranks 4-7 hold the second stage
    assert (staged.stage_world, staged.data_world, staged.loss_world, staged.fsdp_shard) == (4, 4, 4, 4)
    assert [staged.data_rank(r) for r in range(8)] == [0, 1, 2, 3] * 2
    assert staged.coordinates(5)["pp"] == 1 and staged.placement(5) == "pp 1 of 2, dp_shard 1 of 4"
    # hybrid under pp: the default shard group is one machine's ranks of a stage (a machine may hold two stages)
    hybrid = dict(ddp_backend="fully_sharded", sharding_strategy="hybrid_shard", pp=2)
    assert sizes(parallel_shape(4, local_world_size=4, **hybrid))[:2] == (1, 2)
    assert sizes(parallel_shape(16, local_world_size=4, **hybrid))[:2] == (2, 4)
    assert shape.shard_axis == "dp_shard_cp" and parallel_shape(4, "fully_sharded").shard_axis == "dp_shard"
    assert (
        shape.placement(13) == "dp_replicate 1 of 2, dp_shard 1 of 2, cp 0 of 2, tp 1 of 2, ep 2 of 4"
    )  # the heartbeat's words
    assert parallel_shape(4).placement(3) == ""  # plain DDP: a rank is only its number
    one = ParallelDims.single()
    assert (one.data_rank, one.data_world, one.loss_world, one.group("dp_replicate", "dp_shard", "cp")) == (
        0,
        1,
        1,
        None,
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(world=8, tp=3), r"^--model-parallel-size 3: must divide the world size 8 "),
        (dict(world=8, tp=0), r"^--model-parallel-size 0: must be >= 1"),
        (
            dict(world=8, tp=2, cp=3),
            r"^--context-parallel-size 3: must divide the 4 ranks left by --model-parallel-size 2",
        ),
        (dict(world=8, cp=-1), r"^--context-parallel-size -1: must be >= 1"),
        (dict(world=8, ddp_backend="fully_sharded", ep=3), r"^--expert-parallel-size 3: must divide the 8 ranks"),
        (
            dict(world=8, ddp_backend="fully_sharded", cp=2, ep=16),
            r"^--expert-parallel-size 16: must divide the 8 ranks that shard one replica \(dp_shard 4 x "
            r"--context-parallel-size 2\)",
        ),
        (
            dict(world=8, tp=2, cp=2, ep=8),  # under TP the experts are spread over every data-parallel rank
            r"^--expert-parallel-size 8: must divide the 4 ranks left by --model-parallel-size 2 \(world 8 / 2\)",
        ),
        (
            dict(world=8, ep=3),
            r"^--expert-parallel-size 3: must divide the 8 ranks that replicate the model \(DDP, "
            r"no_shard\)",
        ),
        (
            dict(world=8, ddp_backend="fully_sharded", sharding_strategy="no_shard", ep=3),
            r"^--expert-parallel-size 3: must divide the 8 ranks that replicate the model \(DDP, no_shard\)",
        ),
        (dict(world=8, ep=0), r"^--expert-parallel-size 0: must be >= 1"),
        (
            dict(world=8, ddp_backend="fully_sharded", sharding_strategy="hybrid_shard", shard_group_size=3),
            r"^--shard-group-size 3: must divide the 8 data-parallel ranks",
        ),
        (
            dict(world=8, ddp_backend="fully_sharded", sharding_strategy="hybrid_shard", shard_group_size=4, tp=4),
            r"^--shard-group-size 4: must divide the 2 data-parallel ranks \(world size 8 / \(--model-parallel-size 4",
        ),
        (dict(world=8, ddp_backend="fully_sharded", sharding_strategy="zero3"), r"^--sharding-strategy zero3: choose"),
    ],
)
def test_each_axis_named_in_one_line(kwargs, message):
    with pytest.raises(UserError, match=message) as err:
        parallel_shape(**kwargs)
    assert "\n" not in str(err.value)


def test_expert_shard_is_the_replica_shards_holding_the_same_experts():
    """The experts' FSDP2 shard axis: (dp_shard x cp) / ep under full_shard and hybrid sharding, 1 where the ep ranks
    are whole replicas (no_shard, DDP)."""
    assert parallel_shape(8, "fully_sharded", ep=2).expert_shard == 4
    assert parallel_shape(8, "fully_sharded", "hybrid_shard", shard_group_size=4, ep=2).expert_shard == 2
    assert parallel_shape(8, "fully_sharded", "hybrid_shard", shard_group_size=2, cp=2, ep=4).expert_shard == 1
    assert parallel_shape(8, "fully_sharded", "no_shard", ep=2).expert_shard == 1
    assert parallel_shape(8, ep=2).expert_shard == 1


def test_config_flags_reach_the_shape():
    cfg = DistributedConfig(
        ddp_backend="fully_sharded", model_parallel_size=2, context_parallel_size=2, expert_parallel_size=2
    )
    assert sizes(shape_from_config(cfg, 8)) == (1, 2, 2, 2, 2)


def test_model_capabilities_refuse_with_the_physical_reason():
    """What the model's class cannot fill is refused by toolkit/config/composition.py (its MODEL conditions)."""
    from toolkit.config.composition import model_refusal
    from toolkit.models.llama.model import LlamaLanguageModel

    def refused(arch: str, model_cls, **sizes):
        dist = dataclasses.replace(DistributedConfig(), **sizes)
        return model_refusal(
            SimpleNamespace(distributed=dist, components=SimpleNamespace(arch=arch), model=None), model_cls
        )

    assert refused("llama", LlamaLanguageModel) is None  # no cp / ep axis: nothing to ask
    assert refused("llama", LlamaLanguageModel, expert_parallel_size=2) == (
        "--expert-parallel-size 2: --arch llama has no expert (MoE) layers to place; use a MoE architecture or drop "
        "the flag"
    )
    assert refused("llama", LlamaLanguageModel, context_parallel_size=2) is None
    from toolkit.models.transformer_lm import TransformerLanguageModel

    assert refused("transformer_lm", TransformerLanguageModel, context_parallel_size=2).startswith(
        "--context-parallel-size 2: --arch transformer_lm's attention does not exchange keys/values across ranks"
    )

    class WithRingAttentionAndExperts(LlamaLanguageModel):  # what a family does once it has both: flip the flags
        supports_expert_parallel = True

    assert refused("x", WithRingAttentionAndExperts, context_parallel_size=2, expert_parallel_size=2) is None


MODEL = [
    "--arch",
    "transformer_lm",
    "--decoder-layers",
    "2",
    "--decoder-embed-dim",
    "32",
    "--decoder-attention-heads",
    "2",
    "--decoder-ffn-embed-dim",
    "64",
    "--tokens-per-sample",
    "16",
]


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--distributed-world-size", "8", "--model-parallel-size", "3"], "^--model-parallel-size 3: must divide"),
        (
            ["--distributed-world-size", "4", "--ddp-backend", "fully_sharded", "--context-parallel-size", "2"],
            r"^--context-parallel-size 2: --arch transformer_lm's attention does not exchange keys/values",
        ),
        (
            ["--distributed-world-size", "4", "--expert-parallel-size", "2"],
            r"^--expert-parallel-size 2: --arch transformer_lm has no expert \(MoE\) layers",
        ),
        (["--distributed-world-size", "4", "--context-parallel-size", "3"], "^--context-parallel-size 3: must divide"),
    ],
)
def test_train_and_plan_refuse_the_same_layouts(flags, message, tmp_path):
    """toolkit-train resolves (before any rank starts) and toolkit-plan plans through the same check."""
    from toolkit.plan import PRESETS, make_plan
    from toolkit.plan.setup import setup_from_config
    from toolkit.train.resolve import parse_train_config

    argv = [str(tmp_path), "--cpu", *MODEL, *flags]
    with pytest.raises(UserError, match=message):
        parse_train_config(argv)
    ok = parse_train_config([str(tmp_path), "--cpu", *MODEL, "--distributed-world-size", "8"])
    if "--model-parallel-size" in flags:  # the planner's own world (make_plan's override) is checked too
        tp3 = dataclasses.replace(ok, distributed=dataclasses.replace(ok.distributed, model_parallel_size=3))
        with pytest.raises(UserError, match=message):
            make_plan(tp3, PRESETS["h100"], vocab_size=64)
        with pytest.raises(UserError, match="^--model-parallel-size 2: must divide the world size 5"):
            make_plan(
                dataclasses.replace(tp3, distributed=dataclasses.replace(tp3.distributed, model_parallel_size=2)),
                PRESETS["h100"],
                vocab_size=64,
                world_size=5,
            )
    assert setup_from_config(ok, gpu=True).layout(8).dp_replicate == 8  # c10d on 8 ranks: 8 replicas
