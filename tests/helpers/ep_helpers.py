"""Worker of the expert-parallel dispatch test (tests/integration/test_expert_parallel.py): spawned per rank."""
import copy

import torch
import torch.distributed as dist

from toolkit.models.blocks.moe import EXPERT_PROJECTIONS, MoE

EXPERTS, TOP_K, WIDTH, TOKENS = 4, 2, 16, 12


def dispatch_matches_local(rank: int, world: int, out_dir: str) -> dict:
    """One MoE layer whole on every rank (the reference, fed every rank's tokens) and placed over the ranks (fed
    this rank's): the same outputs, input gradients, and for this rank's experts the same weight gradients."""
    torch.manual_seed(0)
    whole = MoE(WIDTH, WIDTH, num_experts=EXPERTS, top_k=TOP_K, shared_hidden=WIDTH)
    for p in whole.parameters():
        torch.nn.init.normal_(p, std=0.3)
    placed = copy.deepcopy(whole)
    placed.experts.place(dist.group.WORLD, rank, world)
    x_all = torch.randn(world, 1, TOKENS, WIDTH, requires_grad=True)
    probe = torch.randn(world, 1, TOKENS, WIDTH)  # the loss: a fixed projection of the output
    (whole(x_all.flatten(0, 1)) * probe.flatten(0, 1)).sum().backward()
    x = x_all.detach()[rank].clone().requires_grad_()
    y = placed(x)
    (y * probe[rank]).sum().backward()
    torch.testing.assert_close(y, whole(x_all.flatten(0, 1))[rank:rank + 1])
    torch.testing.assert_close(x.grad, x_all.grad[rank])
    local = EXPERTS // world
    for name in EXPERT_PROJECTIONS:
        want = getattr(whole.experts, name).grad[rank * local:(rank + 1) * local]
        torch.testing.assert_close(getattr(placed.experts, name).grad, want)
    router = placed.gate.weight.grad.clone()  # from this rank's tokens: summed over the ranks, the whole gradient
    dist.all_reduce(router)
    torch.testing.assert_close(router, whole.gate.weight.grad)
    return {"state": {k: v.clone() for k, v in placed.state_dict().items()}, "whole": whole.state_dict()}
