"""Runs started by Slurm's ``srun ... toolkit-train ... --distributed-port P`` (fairseq's ``_infer_slurm_init``).

fairseq reads the job's layout from Slurm's environment when ``--distributed-port`` is
given and torchrun's variables are not set; so does this module. It only computes the
standard rendezvous variables (``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``); the ranks then meet through torch's ``env://`` rendezvous like any
torchrun worker (:mod:`toolkit.distributed.utils`).

- ``MASTER_ADDR`` is the first host of the step's (else the job's) node list, expanded by
  ``scontrol show hostnames`` when it is on PATH, else by :func:`parse_nodelist`;
  ``MASTER_PORT`` is ``--distributed-port``.
- One task per GPU (``--ntasks-per-node`` > 1): each task is one rank, ``RANK`` =
  ``SLURM_PROCID``, ``LOCAL_RANK`` = ``SLURM_LOCALID``, ``WORLD_SIZE`` = nodes x tasks per node.
- One task per node: each task spawns one worker per visible GPU (with ``--cpu`` or
  without GPUs: ``--distributed-world-size`` / nodes workers, default 1), ranks
  ``SLURM_NODEID`` x workers per node onwards, as fairseq's ``distributed_main`` numbers them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional

from toolkit.core.errors import UserError

NODELIST_KEYS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
TORCHRUN_KEYS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


@dataclass(frozen=True)
class TaskLayout:
    """Where one launcher's processes sit in the job (a Slurm task, or toolkit-train spawning workers)."""

    master_addr: str
    port: int
    world_size: int
    start_rank: int  # RANK of this task's first process
    local_procs: int  # processes this task runs: 1 (it is a rank) or the workers it spawns
    local_rank_offset: int  # LOCAL_RANK of the first one (SLURM_LOCALID with one task per GPU)
    local_world_size: int
    node_id: int

    def rank_env(self, index: int) -> Dict[str, str]:
        """The rendezvous variables of this task's ``index``-th process."""
        return {
            "RANK": str(self.start_rank + index),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank_offset + index),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_id),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.port),
        }


def nodelist_from_env(environ: Mapping[str, str]) -> Optional[str]:
    return next((environ[k] for k in NODELIST_KEYS if environ.get(k)), None)


def applies(port: int, environ: Mapping[str, str] = os.environ) -> bool:
    """As fairseq: Slurm's layout is used with --distributed-port and without torchrun's variables."""
    if port <= 0 or nodelist_from_env(environ) is None:
        return False
    return not all(k in environ for k in TORCHRUN_KEYS)


def parse_nodelist(nodelist: str) -> List[str]:
    """``node[01-03,07],other`` -> node01 node02 node03 node07 other (Slurm's compressed host list).

    Several bracket groups in one name (``rack[1-2]-n[1-2]``) expand as a product, in
    Slurm's order; a range keeps the zero padding of its lower bound.
    """
    hosts: List[str] = []
    for name in _split_top_level(nodelist.strip()):
        hosts += _expand_name(name, nodelist)
    return hosts


def _split_top_level(text: str) -> List[str]:
    """Split at commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_name(name: str, whole: str) -> List[str]:
    m = re.match(r"^([^\[\]]*)\[([^\[\]]+)\](.*)$", name)
    if m is None:
        if "[" in name or "]" in name:
            raise UserError(f"$SLURM_JOB_NODELIST={whole!r}: unbalanced brackets in {name!r}")
        return [name]
    prefix, ranges, rest = m.groups()
    tails = _expand_name(rest, whole) if rest else [""]
    return [prefix + item + tail for item in _expand_ranges(ranges, whole) for tail in tails]


def _expand_ranges(ranges: str, whole: str) -> List[str]:
    items: List[str] = []
    for part in ranges.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if m is None:
            raise UserError(f"$SLURM_JOB_NODELIST={whole!r}: {part!r} is not a number or a range N-M")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise UserError(f"$SLURM_JOB_NODELIST={whole!r}: the range {part!r} runs backwards")
        items += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    return items


def expand_nodelist(nodelist: str) -> List[str]:
    """The host names of a node list: ``scontrol show hostnames`` when it is on PATH (as fairseq), else parsed."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return parse_nodelist(nodelist)
    try:
        out = subprocess.run(
            [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, check=True, timeout=60
        ).stdout
    except (subprocess.SubprocessError, OSError) as e:
        raise UserError(f"scontrol show hostnames {nodelist}: failed ({e}); is this a Slurm job step?") from None
    return out.split()


def _env_int(environ: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = environ.get(name)
        if value:
            m = re.match(r"^\s*(\d+)", value)  # SLURM_TASKS_PER_NODE-style "2(x3)" counts as 2
            if m is None:
                raise UserError(f"${name}={value!r}: expected an integer (set by srun)")
            return int(m.group(1))
    return None


def _required(environ: Mapping[str, str], *names: str) -> int:
    value = _env_int(environ, *names)
    if value is None:
        raise UserError(
            f"${names[0]} is not set: started by srun with --distributed-port, toolkit-train reads "
            f"the job's layout from Slurm's variables; run it through srun, or leave out "
            f"--distributed-port"
        )
    return value


def plan_from_env(
    port: int,
    world_size_given: int,
    gpus: int,
    environ: Mapping[str, str] = os.environ,
    hostnames: Callable[[str], List[str]] = expand_nodelist,
) -> Optional[TaskLayout]:
    """This task's place in the job, or None when Slurm's layout does not apply (see :func:`applies`).

    ``gpus`` is the number of GPUs a process may use on this node (0 under --cpu);
    ``world_size_given`` is --distributed-world-size (1 when not given).
    """
    if not applies(port, environ):
        return None
    nodelist = nodelist_from_env(environ)
    hosts = hostnames(nodelist)
    if not hosts:
        raise UserError(f"$SLURM_JOB_NODELIST={nodelist!r}: no host names in it")
    nnodes = _required(environ, "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    per_node = _env_int(environ, "SLURM_NTASKS_PER_NODE")
    if per_node is None:
        ntasks = _required(environ, "SLURM_NTASKS")
        if ntasks % nnodes:
            raise UserError(
                f"$SLURM_NTASKS={ntasks} does not split evenly over $SLURM_NNODES={nnodes}; "
                f"start the same number of tasks on every node (srun --ntasks-per-node)"
            )
        per_node = ntasks // nnodes
    if per_node == 1:
        return _one_task_per_node(hosts[0], port, nnodes, world_size_given, gpus, environ)
    world = nnodes * per_node
    if 0 < gpus < per_node:  # fairseq would call cuda.set_device(SLURM_LOCALID) on a GPU the task cannot see
        raise UserError(
            f"srun started {per_node} tasks per node, but each sees {gpus} GPU(s) (LOCAL_RANK = "
            f"$SLURM_LOCALID picks the GPU); let every task see the node's GPUs (no --gpus-per-task), "
            f"or start one task per node (it spawns one process per GPU)"
        )
    if world_size_given not in (1, world):
        raise UserError(
            f"--distributed-world-size {world_size_given}, but srun started {world} tasks "
            f"({nnodes} nodes x {per_node}); drop the flag or make it {world}"
        )
    return TaskLayout(
        master_addr=hosts[0],
        port=port,
        world_size=world,
        start_rank=_required(environ, "SLURM_PROCID"),
        local_procs=1,
        local_rank_offset=_required(environ, "SLURM_LOCALID"),
        local_world_size=per_node,
        node_id=_env_int(environ, "SLURM_NODEID") or 0,
    )


def _one_task_per_node(
    master: str, port: int, nnodes: int, world_size_given: int, gpus: int, environ: Mapping[str, str]
) -> TaskLayout:
    """Each task spawns its node's workers: one per GPU, or on CPU --distributed-world-size / nodes."""
    if gpus > 0:
        procs = gpus
    elif world_size_given % nnodes:
        raise UserError(
            f"--distributed-world-size {world_size_given} does not split evenly over the job's "
            f"{nnodes} nodes (one srun task per node); give a multiple of {nnodes}"
        )
    else:
        procs = max(1, world_size_given // nnodes)
    world = nnodes * procs
    if world_size_given not in (1, world):
        raise UserError(
            f"--distributed-world-size {world_size_given}, but the job has {nnodes} nodes with "
            f"{gpus} GPUs each (one srun task per node, one process per GPU); drop the flag or "
            f"make it {world}"
        )
    node_id = _env_int(environ, "SLURM_NODEID", "SLURM_PROCID") or 0
    return TaskLayout(
        master_addr=master,
        port=port,
        world_size=world,
        start_rank=node_id * procs,
        local_procs=procs,
        local_rank_offset=0,
        local_world_size=procs,
        node_id=node_id,
    )
