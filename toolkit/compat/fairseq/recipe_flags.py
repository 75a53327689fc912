"""fairseq recipe flags that toolkit-train accepts, each with fairseq's meaning or one INFO line saying why it
has no effect here (called by :func:`toolkit.compat.fairseq.flags.resolve_fairseq_flags`).

=================================  ===========================================================
``--memory-efficient-bf16``        ``--bf16`` (one INFO line): bf16 compute without loss scaling
``--empty-cache-freq N``           ``torch.cuda.empty_cache()`` every N updates on a GPU (the train
                                   loop's ``empty_cache_due``); INFO "no effect" on CPU
``--all-gather-list-size``         INFO "no effect": logging stats are all-reduced as tensors, there
                                   is no pickled buffer to size
``--distributed-no-spawn``         INFO "no effect" under torchrun/srun or for one process; several
                                   processes with no launcher is an error (fairseq would wait for
                                   ranks nobody starts)
=================================  ===========================================================
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, List, Set, Tuple

from toolkit.core.errors import UserError

LAUNCHER_ENV = ("WORLD_SIZE", "SLURM_PROCID")


def resolve_recipe_flags(common: Any, dist: Any, explicit: Set[str], gpu: bool) -> Tuple[Any, List[str]]:
    """``common`` with --memory-efficient-bf16 applied, and one line per flag given that changes nothing."""
    lines: List[str] = []
    if common.memory_efficient_bf16:
        if common.fp16 or common.memory_efficient_fp16:
            raise UserError("--memory-efficient-bf16 and --fp16/--memory-efficient-fp16 conflict; choose one")
        common = dataclasses.replace(common, bf16=True)
        lines.append(
            "--memory-efficient-bf16: training with --bf16 (bf16 compute, no loss scaling; the optimizer "
            "keeps its fp32 state as under --bf16)"
        )
    if common.empty_cache_freq > 0 and not gpu:
        lines.append(
            f"--empty-cache-freq {common.empty_cache_freq}: accepted, no effect without a GPU (it empties "
            f"the CUDA caching allocator)"
        )
    if "all_gather_list_size" in explicit:
        lines.append(
            f"--all-gather-list-size {common.all_gather_list_size}: accepted, no effect (logging stats "
            f"are all-reduced as tensors here; there is no fixed-size buffer)"
        )
    lines += _no_spawn(dist)
    return common, lines


def _no_spawn(dist: Any) -> List[str]:
    if not dist.distributed_no_spawn:
        return []
    if any(os.environ.get(name) for name in LAUNCHER_ENV):
        return [
            "--distributed-no-spawn: accepted, no effect (started by torchrun/srun: each process is one rank, "
            "nothing is spawned)"
        ]
    if dist.distributed_world_size > 1:
        raise UserError(
            f"--distributed-no-spawn with --distributed-world-size {dist.distributed_world_size} and "
            f"no launcher: start the ranks with torchrun --nproc-per-node "
            f"{dist.distributed_world_size} (or drop --distributed-no-spawn to spawn them here)"
        )
    return ["--distributed-no-spawn: accepted, no effect (one process: nothing to spawn)"]
