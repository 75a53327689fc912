"""A spawned rank's check of ``--z-loss-coef`` with vocabulary-sharded logits (``tests.helpers.tp_helpers.spawn``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def worker_vocab_parallel_z_loss(rank: int, world_size: int, out_dir: str) -> dict:
    """The criterion on the same logits, whole on each rank and as a DTensor split over the vocabulary under
    ``loss_parallel``: the loss, the logged ``z_loss`` and the logits' gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    from toolkit.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig
    from toolkit.data.dictionary import Dictionary

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    whole = (torch.randn(2, 4, 12) * 3).requires_grad_()
    target = torch.tensor([[4, 5, 2, 7], [6, 3, 1, 1]])  # 1 is the padding
    sample = {"nsentences": 2, "ntokens": 6, "net_input": {"src_tokens": target}, "target": target}
    crit = CrossEntropyCriterion(
        SimpleNamespace(target_dictionary=Dictionary()), CrossEntropyCriterionConfig(z_loss_coef=0.03)
    )
    want, _, want_log = crit(whole, sample)
    want.backward()
    sharded = distribute_tensor(whole.detach(), mesh, [Shard(-1)]).requires_grad_()
    with loss_parallel():
        got, _, got_log = crit(sharded, sample)
        got.backward()
    return {
        "loss": (got.detach(), want.detach()),
        "z_loss": (got_log["z_loss"], want_log["z_loss"]),
        "grad": (sharded.grad.full_tensor(), whole.grad),
    }
