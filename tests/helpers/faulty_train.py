"""toolkit-train with a fault injected: ``python -m tests.helpers.faulty_train ARGS`` (tests only).

``TOOLKIT_FAULT_KILL_IN_SAVE=RANK:N`` kills rank RANK (SIGKILL) in its N-th sharded save,
right after it wrote its shard and before the checkpoint is complete. The patch is made
at import, so the spawned workers (which re-import this main module) get it too.
"""

import logging
import os
import signal

import torch
import torch.distributed.checkpoint as dcp

from toolkit.checkpoint import sharded
from toolkit_cli.train import cli_main

FAULT_ENV = "TOOLKIT_FAULT_KILL_IN_SAVE"
logger = logging.getLogger(__name__)
_saves = [0]


class KillingWriter(dcp.FileSystemWriter):
    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        future.wait()
        logger.warning(f"{FAULT_ENV}: killing rank {torch.distributed.get_rank()} in the middle of a save")
        os.kill(os.getpid(), signal.SIGKILL)
        return future


def faulty_writer(path: str) -> dcp.FileSystemWriter:
    _saves[0] += 1
    spec = os.environ.get(FAULT_ENV, "")
    if spec and torch.distributed.is_initialized():
        rank, n = (int(x) for x in spec.split(":"))
        if rank == torch.distributed.get_rank() and n == _saves[0]:
            return KillingWriter(path)
    return dcp.FileSystemWriter(path)


sharded._writer = faulty_writer

if __name__ == "__main__":
    cli_main()
