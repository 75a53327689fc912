"""Worker of the expert-parallel dispatch test (tests/integration/test_expert_parallel.py): spawned per rank."""

import copy

import torch
import torch.distributed as dist

from toolkit.distributed.expert_parallel import global_grad_norm
from toolkit.models.common.moe import EXPERT_PROJECTIONS, MoE

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
    torch.testing.assert_close(y, whole(x_all.flatten(0, 1))[rank : rank + 1])
    torch.testing.assert_close(x.grad, x_all.grad[rank])
    local = EXPERTS // world
    for name in EXPERT_PROJECTIONS:
        want = getattr(whole.experts, name).grad[rank * local : (rank + 1) * local]
        torch.testing.assert_close(getattr(placed.experts, name).grad, want)
    experts = [getattr(placed.experts, name) for name in EXPERT_PROJECTIONS]
    for p in placed.parameters():  # the rest from this rank's tokens: summed over the ranks, the whole gradient
        if all(p is not e for e in experts):
            dist.all_reduce(p.grad)
    torch.testing.assert_close(placed.gate.weight.grad, whole.gate.weight.grad)
    norm = global_grad_norm(list(placed.parameters()), {id(e) for e in experts}, dist.group.WORLD)
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in whole.parameters()])).item()
    assert abs(norm - want) <= 1e-5 * want, (norm, want)
    return {"state": {k: v.clone() for k, v in placed.state_dict().items()}, "whole": whole.state_dict()}
