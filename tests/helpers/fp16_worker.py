"""One rank of toolkit-train with a test-only fault, for tests/integration/test_fp16.py's 2-rank tests::

    python -m tests.helpers.fp16_worker worker {shard|loss} UPDATE -- TRAIN_ARGS...

Rank 1 overflows once, at update UPDATE: ``shard`` puts an inf into its gradient shard after the reduction,
``loss`` blows up its loss before it; every rank prints its final state, so the test sees whether all ranks
skipped the same update.
"""

from __future__ import annotations

import os
import sys


def worker(mode: str, update: int, argv) -> None:
    """One rank of toolkit-train; rank 1 overflows once, at update ``update``; prints its final state."""
    from toolkit.criterions.cross_entropy import CrossEntropyCriterion
    from toolkit.train.trainer import Trainer
    from toolkit_cli.train import cli_main

    rank = int(os.environ["RANK"])
    box = {"trainer": None, "injected": 0}
    init = Trainer.__init__

    def trainer_init(self, *a, **kw):
        init(self, *a, **kw)
        box["trainer"] = self

    def due() -> bool:
        t = box["trainer"]
        return rank == 1 and not box["injected"] and t is not None and t.num_updates == update - 1

    def poison_shard(orig):
        def wrapped(self, *a, **kw):
            if due():  # after the gradient reduction: only this rank's shard holds the inf
                p = next(p for p in self.model.parameters() if p.grad is not None)
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                local.view(-1)[0] = float("inf")
                box["injected"] = 1
            return orig(self, *a, **kw)

        return wrapped

    forward = CrossEntropyCriterion.forward

    def poisoned_forward(self, net_output, sample, reduce=True):
        loss, sample_size, logging_output = forward(self, net_output, sample, reduce)
        if due():  # before the all-reduce: this rank's backward overflows
            box["injected"] = 1
            loss = loss * 1e30
        return loss, sample_size, logging_output

    Trainer.__init__ = trainer_init
    if mode == "shard":
        Trainer._grad_norm_for_step = poison_shard(Trainer._grad_norm_for_step)
    else:
        CrossEntropyCriterion.forward = poisoned_forward
    cli_main(list(argv))
    t = box["trainer"]
    total = sum(float(p.detach().float().sum()) for p in t.model.parameters() if not hasattr(p, "to_local"))
    print(
        f"FINAL rank={rank} injected={box['injected']} num_updates={t.num_updates} "
        f"loss_scale={t.scaler.loss_scale if t.scaler else None} params={total!r}",
        flush=True,
    )


if __name__ == "__main__":
    if len(sys.argv) > 4 and sys.argv[1] == "worker" and sys.argv[4] == "--":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[5:])
    else:
        sys.exit(__doc__)
