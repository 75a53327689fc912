"""Process groups through torch.distributed: torchrun's environment, NCCL on GPU, gloo on CPU.

Every way of starting a run ends up here with the standard variables set:

- ``torchrun --nproc-per-node N [--nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT] toolkit-train ...``
  sets ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``;
- ``toolkit-train --distributed-world-size N`` (one machine) spawns N workers that
  get the same variables from :mod:`toolkit.distributed.launch`;
- a plain ``toolkit-train`` is rank 0 of 1 (no process group, except a one-rank group
  under ``--ddp-backend fully_sharded``, which FSDP2's DTensors need).

After joining, a heartbeat thread (:mod:`toolkit.distributed.heartbeat`) watches
the other ranks, so that a rank that dies or freezes stops the run with a message
naming it instead of a hang.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from toolkit.config import DistributedConfig
from toolkit.core.errors import UserError

logger = logging.getLogger(__name__)

# The environment variables a worker reads (set by torchrun or by our launcher).
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class DistributedEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    local_world_size: int = 1
    backend: Optional[str] = None

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def pick_device(cpu: bool, local_rank: int) -> torch.device:
    """``cuda:LOCAL_RANK`` when a GPU is there (and --cpu is not given), else the CPU."""
    if cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise UserError(
            f"LOCAL_RANK {local_rank}: this machine has only {torch.cuda.device_count()} GPUs; "
            f"start at most one process per GPU (--nproc-per-node / --distributed-world-size)"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def default_backend(device: torch.device, cpu_offload: bool = False) -> str:
    """NCCL on GPUs, gloo on CPUs; both under ``--cpu-offload`` on GPUs.

    With CPU offload the sharded parameters and gradients (DTensors) live in host memory,
    so the gradient-norm reduction, the optimizer's overflow checks and the gathering of a
    consolidated checkpoint run collectives on CPU tensors: those go to gloo, the rest to NCCL.
    """
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if cpu_offload else "nccl"


def pg_timeout(heartbeat_timeout: float) -> datetime.timedelta:
    """How long a collective waits for a missing rank before failing.

    Never less than 30 s: some ranks legitimately wait for others (rank 0 writing a
    consolidated checkpoint, a slow data load). Ranks that die or freeze are caught
    sooner, within ``--heartbeat-timeout``, by the heartbeat.
    """
    return datetime.timedelta(seconds=max(int(heartbeat_timeout), 30))


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise UserError(f"${name}={value!r}: expected an integer (set by torchrun or toolkit-train)") from None


def under_launcher() -> bool:
    """Whether torchrun (or our own spawner) started this process as one rank of a group."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_distributed(cfg: DistributedConfig, cpu: bool = False) -> DistributedEnv:
    """Join the process group torchrun (or our own spawner) describes in the environment."""
    world_size = env_int("WORLD_SIZE", 1)
    rank = env_int("RANK", 0)
    local_rank = env_int("LOCAL_RANK", cfg.device_id or 0)  # torch.distributed.launch's --local-rank if no env
    local_world_size = env_int("LOCAL_WORLD_SIZE", world_size if "WORLD_SIZE" in os.environ else 1)
    if not 0 <= rank < world_size:
        raise UserError(f"RANK {rank} is not in [0, WORLD_SIZE={world_size})")
    if under_launcher() and cfg.distributed_world_size not in (1, world_size):
        raise UserError(
            f"--distributed-world-size {cfg.distributed_world_size} but the launcher started "
            f"{world_size} processes (WORLD_SIZE); drop --distributed-world-size under torchrun"
        )
    device = pick_device(cpu, local_rank)
    backend = process_group_backend(cfg, device)
    env = DistributedEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        local_world_size=local_world_size,
        backend=None,
    )
    if dist.is_initialized():
        env.backend = dist.get_backend()
        return env
    timeout = pg_timeout(cfg.heartbeat_timeout)
    device_id = device if device.type == "cuda" else None
    if world_size > 1:
        dist.init_process_group(
            backend=backend,
            store=_launcher_store(timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device_id,
        )
        env.backend = backend
        logger.info(
            f"distributed init (rank {rank}): {backend}, world size {world_size}, "
            f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        )
        from toolkit.distributed import heartbeat
        from toolkit.distributed.parallel_dims import shape_from_config

        heartbeat.start(
            rank,
            world_size,
            timeout=float(cfg.heartbeat_timeout),
            layout=shape_from_config(cfg, world_size, local_world_size),
        )
    elif cfg.ddp_backend == "fully_sharded":
        # FSDP2 works on DTensors, which need a process group even for one rank.
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, device_id=device_id
        )
        env.backend = backend
    return env


def process_group_backend(cfg: DistributedConfig, device: torch.device) -> str:
    """``--distributed-backend``, or the default for the device (NCCL and gloo side by side under offload)."""
    backend = cfg.distributed_backend or default_backend(device, cpu_offload=cfg.cpu_offload)
    if backend == "nccl" and device.type == "cuda" and cfg.cpu_offload:
        backend = default_backend(device, cpu_offload=True)  # host-memory shards need gloo beside NCCL
    if "nccl" in backend and device.type != "cuda":
        raise UserError("--distributed-backend nccl needs GPUs; use gloo (the default without GPUs)")
    return backend


def _launcher_store(timeout: datetime.timedelta):
    """The store our own spawner hosts (toolkit.distributed.launch); None under torchrun (env:// rendezvous)."""
    if os.environ.get("TOOLKIT_LAUNCHER_STORE") != "1":
        return None
    return dist.PrefixStore(
        "toolkit/pg/",
        dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            wait_for_workers=False,
            timeout=timeout,
        ),
    )


def shutdown(ok: bool = True, error: Optional[BaseException] = None) -> None:
    """Leave the process group (tell the heartbeat first, so the others do not take our exit for a crash)."""
    from toolkit.distributed import heartbeat

    heartbeat.stop(ok=ok, error=error)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # the group may already be broken by the failure we are reporting
            pass


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return s.getsockname()[1]


def all_reduce_sums(
    values: Dict[str, float], device: torch.device, world_size: int, group: Any = None
) -> Dict[str, float]:
    """Sum a dict of numbers across the ``world_size`` ranks of ``group`` (default: all) in one collective."""
    keys = sorted(values)
    if world_size == 1 or not keys or not dist.is_initialized():
        return {k: float(values[k]) for k in keys}
    buf = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(buf, group=group)
    return dict(zip(keys, buf.tolist()))


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` from rank ``src`` on every rank (the object itself without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_ranks_agree(flag: bool, device: torch.device) -> bool:
    """True when the flag is true on every rank (e.g. 'should stop')."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([0.0 if flag else 1.0], device=device)
    dist.all_reduce(t)
    return t.item() == 0.0


def any_rank(flag: bool, device: torch.device) -> bool:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t)
    return t.item() > 0.0


def rescale_iterator_state(
    state: Optional[Dict[str, Any]], saved_world_size: Optional[int], world_size: int
) -> Optional[Dict[str, Any]]:
    """The data position of a checkpoint saved on another world size.

    The iterator counts the batches *this rank* consumed; rank r of W takes batches
    r, r + W, ... So ``n`` batches per rank on W ranks are ``n * W`` batches of the
    epoch, i.e. ``n * W / W'`` per rank on W' ranks (with the same --update-freq * W,
    the same updates).
    """
    if not state or not saved_world_size or saved_world_size == world_size:
        return state
    if "samples_in_epoch" in state:  # a sample count: the iterator maps it onto any number of replicas
        return state
    n = int(state.get("iterations_in_epoch", 0))
    consumed = n * int(saved_world_size)
    if consumed % world_size:
        logger.warning(
            f"checkpoint saved on {saved_world_size} ranks after {consumed} batches of epoch "
            f"{state.get('epoch')}, which do not split evenly over {world_size} ranks; "
            f"resuming after {consumed // world_size * world_size}"
        )
    state = dict(state)
    state["iterations_in_epoch"] = consumed // world_size
    logger.info(
        f"data position: {n} batches per rank on {saved_world_size} ranks = "
        f"{state['iterations_in_epoch']} per rank on {world_size}"
    )
    return state
