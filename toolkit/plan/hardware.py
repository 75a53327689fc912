"""The machine a plan is for: GPU memory and speed, host memory, links (``--gpu h100`` and the rest).

Why presets: a user planning a cluster run knows the card's name, not its NVLink bandwidth. The
figures are the datasheets' (dense bf16 TFLOP/s, NVLink per direction, one NIC per GPU as in
NVIDIA's DGX/HGX nodes, PCIe for the host link); the flags override any of them. Bandwidths are
in gigabits per second (as NICs are sold): ``--inter-node-gbps 400`` is one 400 Gb/s NIC per GPU.

``--gpu cpu`` plans for this kind of machine: no GPU, every byte in host memory (what the CPU
checks in ``benchmarks/plan_check.py`` measure).

Host memory is the one figure a preset cannot know (a node of the same GPUs comes with 0.5 to 2 TiB): without
``--host-memory`` the plan takes this machine's (:func:`machine_memory`), and says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from toolkit.config.flag_types import positive_float, positive_int, share
from toolkit.core.errors import UserError

GIB = 1 << 30
MAX_BYTES = 1 << 50  # 1PiB: more than any one GPU or node holds
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


@dataclass(frozen=True)
class Hardware:
    """One kind of node. ``gpu_memory`` 0 means no GPU (everything lives in host memory)."""

    name: str
    gpu_memory: int
    host_memory: int  # per node, shared by its ranks
    gpu_tflops: float  # dense peak for the run's compute dtype (bf16/fp16; fp32 runs use fp32_tflops)
    fp32_tflops: float
    intra_node_gbps: float  # per GPU and direction (NVLink)
    inter_node_gbps: float  # per GPU and direction (its NIC)
    host_link_gbps: float  # GPU <-> host (PCIe), per direction
    gpus_per_node: int = 8
    compute_efficiency: float = 0.45  # share of the peak a step's FLOPs run at (measured: gpt3_xl on H100)
    comm_efficiency: float = 0.7  # share of a link's bandwidth a collective reaches
    cpu_adam_gparams: float = 2.5  # 1e9 parameters/s CPU Adam updates on a node (6.5B offloaded on the H100 VM)
    host_memory_source: str = "the preset's"  # where host_memory comes from (the plan says it)

    @property
    def has_gpu(self) -> bool:
        return self.gpu_memory > 0


PRESETS: Dict[str, Hardware] = {
    "a100-40": Hardware("A100 40GB", 40 * GIB, 1 << 40, 312.0, 19.5, 2400.0, 200.0, 200.0),
    "a100-80": Hardware("A100 80GB", 80 * GIB, 2 << 40, 312.0, 19.5, 2400.0, 200.0, 200.0),
    "h100": Hardware("H100 80GB", 80 * GIB, 2 << 40, 989.4, 66.9, 3600.0, 400.0, 400.0),
    "h200": Hardware("H200 141GB", 141 * 10**9, 2 << 40, 989.4, 66.9, 3600.0, 400.0, 400.0),
    "cpu": Hardware("CPU only", 0, 0, 0.2, 0.2, 80.0, 10.0, 80.0, gpus_per_node=1, compute_efficiency=0.5),
}


def parse_bytes(text: str, flag: str) -> int:
    """``80GiB``, ``1TiB``, ``126GB``, ``5e9``: a byte count, or a one-line error naming ``flag``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise UserError(f"{flag} {text!r}: expected a size such as 80GiB, 1TiB or 126GB")
    size = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not 1 <= size <= MAX_BYTES:  # 0 plans nothing (and "fits"); 1e400 is inf
        raise UserError(
            f"{flag} {text}: must be between 1 byte and 1PiB (e.g. 80GiB); for a machine without a GPU use --gpu cpu"
        )
    return int(size)


def add_hardware_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("hardware (toolkit-plan)")
    g.add_argument("--gpu", default="h100", choices=sorted(PRESETS), help="preset the figures below (default: h100)")
    g.add_argument("--gpu-memory", default=None, help="memory of one GPU, e.g. 80GiB")
    g.add_argument("--host-memory", default=None, help="host memory of one node, e.g. 1TiB (default: this machine's)")
    g.add_argument("--gpu-tflops", type=positive_float, default=None, help="dense bf16/fp16 peak TFLOP/s of one GPU")
    g.add_argument("--intra-node-gbps", type=positive_float, default=None, help="NVLink Gb/s per GPU and direction")
    g.add_argument("--inter-node-gbps", type=positive_float, default=None, help="network Gb/s per GPU and direction")
    g.add_argument("--host-link-gbps", type=positive_float, default=None, help="GPU-host (PCIe) Gb/s per direction")
    g.add_argument("--gpus-per-node", type=positive_int, default=None, help="GPUs (ranks) per node (default: 8)")
    g.add_argument(
        "--compute-efficiency",
        type=share,
        default=None,
        help="share of the peak the step's FLOPs reach, in (0, 1] (default 0.45: gpt3_xl measured on one H100)",
    )
    g.add_argument(
        "--cpu-adam-gparams",
        type=positive_float,
        default=None,
        help="1e9 parameters/s CPU Adam updates on one node (default 2.5: the 16-core H100 VM)",
    )


HARDWARE_FLAGS = (
    "--gpu",
    "--gpu-memory",
    "--host-memory",
    "--gpu-tflops",
    "--intra-node-gbps",
    "--inter-node-gbps",
    "--host-link-gbps",
    "--gpus-per-node",
    "--compute-efficiency",
    "--cpu-adam-gparams",
)


class _HardwareParser(argparse.ArgumentParser):
    """A bad hardware figure is bad input like any other: one line, exit 1 (argparse would print its usage)."""

    def error(self, message: str):  # type: ignore[override]
        raise UserError(message)


def split_hardware_args(argv: Sequence[str]) -> Tuple[argparse.Namespace, List[str]]:
    """(the hardware flags, the rest of ``argv`` for the training parser)."""
    parser = _HardwareParser(prog="toolkit-plan", add_help=False, allow_abbrev=False)
    add_hardware_args(parser)
    ns, rest = parser.parse_known_args(list(argv))
    return ns, rest


MEMINFO, CGROUP_MEMORY_MAX = "/proc/meminfo", "/sys/fs/cgroup/memory.max"


def machine_memory() -> int:
    """This machine's memory in bytes: the physical memory (``os.sysconf``, else ``/proc/meminfo``), or the
    container's limit (cgroup v2 ``memory.max``) where that is lower; 0 when neither can be read."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = _meminfo_total()
    limit = _read_int(CGROUP_MEMORY_MAX)
    return min(total, limit) if total and limit else total or limit


def _meminfo_total() -> int:
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _read_int(path: str) -> int:
    """The integer a kernel file holds ("max", absent or unreadable: 0)."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def with_machine_memory(hw: Hardware) -> Hardware:
    """``hw`` with this machine's memory as the host's (the preset's figure where it cannot be read)."""
    memory = machine_memory()
    return dataclasses.replace(hw, host_memory=memory, host_memory_source="this machine's") if memory else hw


def hardware_from_args(ns: argparse.Namespace) -> Hardware:
    """The preset of ``--gpu`` with the explicit flags over it (each checked: positive); host memory is this
    machine's unless ``--host-memory`` gives it."""
    hw = PRESETS[ns.gpu]
    changes: Dict[str, object] = {}
    if ns.gpu_memory is not None:
        changes["gpu_memory"] = parse_bytes(ns.gpu_memory, "--gpu-memory")
    if ns.host_memory is None:
        hw = with_machine_memory(hw)
    else:
        changes["host_memory"] = parse_bytes(ns.host_memory, "--host-memory")
        changes["host_memory_source"] = "--host-memory"
    for name in (
        "gpu_tflops",
        "intra_node_gbps",
        "inter_node_gbps",
        "host_link_gbps",
        "gpus_per_node",
        "compute_efficiency",
        "cpu_adam_gparams",
    ):
        value = getattr(ns, name)
        if value is not None:
            if value <= 0:
                raise UserError(f"--{name.replace('_', '-')} {value}: must be positive")
            changes[name] = value
    return dataclasses.replace(hw, **changes)


def detect_hardware() -> Hardware:
    """This machine's GPU (by its name, memory as reported) or ``cpu``: for ``toolkit-train --plan``."""
    import torch

    if not torch.cuda.is_available():
        return with_machine_memory(PRESETS["cpu"])
    name = torch.cuda.get_device_name()
    key: Optional[str] = next(
        (k for k, pattern in (("h200", "H200"), ("h100", "H100"), ("a100-80", "A100")) if pattern in name), None
    )
    base = with_machine_memory(PRESETS[key] if key else PRESETS["h100"])
    return dataclasses.replace(base, name=name, gpu_memory=torch.cuda.get_device_properties(0).total_memory)
