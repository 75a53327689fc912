"""The open vocabulary of tensor-parallel kinds (toolkit.distributed.tensor_parallel.register_tp_style): a kind
registered at run time is applied by ``apply_tensor_parallel`` and counted by ``toolkit-plan``; a plan naming an
unregistered kind, or placing experts, is refused in one line naming the family and the module."""

from __future__ import annotations

from typing import Dict

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.helpers import free_port
from toolkit.core.errors import UserError
from toolkit.core.protocols import TensorParallelPlan
from toolkit.distributed import tensor_parallel as tp

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")

VOCAB, WIDTH = 16, 8


class ToyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.mix(x))


class ToyLM(nn.Module):
    """A family whose plan names its own kind, ``block_kind``, for every block's ``mix``."""

    def __init__(self, block_kind: str = "toy_scaled_copy", experts: Dict[str, str] = None):
        super().__init__()
        self.block_kind, self.experts = block_kind, experts or {}
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([ToyBlock(), ToyBlock()])
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        return self.head(x)

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        return TensorParallelPlan(
            top={"embed": "vocab_embedding", "head": "output"},
            block={"mix": self.block_kind},
            divisible=(),
            positions=4,
            hidden="layers.1",
            experts=self.experts,
        )


@pytest.fixture
def toy_kind():
    """``toy_scaled_copy``: weights replicated (DTensor), computed on plain tensors; records each build."""
    built = []

    @tp.register_tp_style("toy_scaled_copy")
    def build(ctx):
        built.append(ctx)
        return tp._ReplicatedParallel.style()

    yield built
    del tp.TP_STYLES["toy_scaled_copy"]


@pytest.fixture
def one_rank_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def test_a_kind_registered_at_run_time_is_applied(toy_kind, one_rank_mesh):
    from torch.distributed.tensor import DTensor, Replicate

    torch.manual_seed(0)
    plain = ToyLM()
    model = ToyLM()
    model.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 4))
    tp.apply_tensor_parallel(model, one_rank_mesh, sequence_parallel=False, loss_parallel=False)
    assert len(toy_kind) == 2 and not toy_kind[0].sequence_parallel  # once per block, with the run's layout
    weight = model.layers[0].mix.weight
    assert isinstance(weight, DTensor) and weight.placements == (Replicate(),)
    torch.testing.assert_close(model(tokens), plain(tokens))


def test_the_planner_counts_a_registered_kinds_split(toy_kind):
    tp.register_tp_style("toy_split_rows", sharded=("weight",))(lambda ctx: None)
    try:
        split = tp.split_parameters(ToyLM("toy_split_rows"))
    finally:
        del tp.TP_STYLES["toy_split_rows"]
    assert split == {"embed.weight", "head.weight", "layers.0.mix.weight", "layers.1.mix.weight"}
    assert tp.split_parameters(ToyLM()) == {"embed.weight", "head.weight"}  # toy_scaled_copy shards nothing


def test_an_unknown_kind_is_one_line_naming_the_family_and_the_kind():
    with pytest.raises(UserError) as e:
        tp.check_plan_kinds(ToyLM("expert_sharded").tensor_parallel_plan(), "ToyLM")
    message = str(e.value)
    assert "\n" not in message and message.startswith("ToyLM.tensor_parallel_plan(): 'mix' has kind 'expert_sharded'")
    assert "register_tp_style" in message and "fused_qkv" in message  # how to add one, and those known
    with pytest.raises(UserError, match="ToyLM.tensor_parallel_plan\\(\\): 'mix' has kind 'expert_sharded'"):
        tp.split_parameters(ToyLM("expert_sharded"))


def test_expert_placement_is_refused_before_anything_is_sharded(toy_kind):
    with pytest.raises(UserError, match="'moe.experts' asks for expert-parallel placement 'ep'"):
        tp.check_plan_kinds(ToyLM(experts={"moe.experts": "ep"}).tensor_parallel_plan(), "ToyLM")


def test_a_kind_is_registered_once():
    with pytest.raises(ValueError, match="'row' is registered twice"):
        tp.register_tp_style("row")(lambda ctx: None)


def test_fsdp_units_come_from_the_plan():
    model = ToyLM()
    assert tp.fsdp_units(model) == list(model.layers)
    plain = nn.Module()
    plain.layers = nn.ModuleList([nn.Linear(2, 2)])
    assert tp.fsdp_units(plain) == list(plain.layers)  # a model without a plan: its blocks
