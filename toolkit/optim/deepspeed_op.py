"""DeepSpeed's CPU Adam C++ op: where it is cached, whether it can be built, and building it (once).

The op is JIT-built by torch's extension loader on first use (about a minute here) and
cached per machine; while it builds, one INFO line says so.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from typing import Any, Sequence, Optional

import torch

from toolkit.core.errors import UserError

logger = logging.getLogger(__name__)

NO_COMPILER_MESSAGE = (
    "--optimizer cpu_adam: DeepSpeed needs a C++ compiler (g++) to build its CPU Adam op; "
    "install one (apt-get install g++) or use --optimizer adam"
)


def cpu_adam_build_dir() -> str:
    """Where torch's JIT extension loader builds and caches DeepSpeed's ``cpu_adam`` op."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        if torch.version.hip is not None:
            accel = "rocm" + torch.version.hip.replace(".", "")
        elif torch.version.cuda is not None:
            accel = "cu" + torch.version.cuda.replace(".", "")
        else:
            accel = "cpu"
        py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{py}_{accel}")
    return os.path.join(root, "cpu_adam")


def _op_precompiled() -> bool:
    try:
        from deepspeed.git_version_info import installed_ops
    except Exception:  # pragma: no cover - very old/odd installs
        return False
    return bool(installed_ops.get("cpu_adam", False))


def _op_loaded_in_process() -> bool:
    try:
        from deepspeed.ops.op_builder.builder import OpBuilder
    except Exception:  # pragma: no cover
        return False
    return "cpu_adam" in getattr(OpBuilder, "_loaded_ops", {})


def cpu_adam_op_cached() -> bool:
    """The op needs no build: loaded already, installed with DeepSpeed, or JIT-built before on this machine."""
    return (
        _op_loaded_in_process()
        or _op_precompiled()
        or os.path.exists(os.path.join(cpu_adam_build_dir(), "cpu_adam.so"))
    )


def cxx_compiler() -> Optional[str]:
    """The compiler torch's extension builder would run (``$CXX``, else ``c++``), if present."""
    for name in filter(None, (os.environ.get("CXX"), "c++", "g++")):
        found = shutil.which(name.split()[0])
        if found:
            return found
        if os.environ.get("CXX"):
            return None  # an explicit $CXX that does not exist: torch would fail with it
    return None


def load_deepspeed_cpu_adam():
    """Import ``DeepSpeedCPUAdam`` and make sure its C++ op is built (logging when it builds now)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except ImportError as e:
        raise UserError(
            f"--optimizer cpu_adam: DeepSpeed is not importable ({e}); pip install deepspeed or use --optimizer adam"
        ) from e
    if not cpu_adam_op_cached():
        if cxx_compiler() is None:
            raise UserError(NO_COMPILER_MESSAGE)
        from torch.utils.cpp_extension import is_ninja_available

        if not is_ninja_available():
            raise UserError(
                "--optimizer cpu_adam: DeepSpeed needs ninja to build its CPU Adam op; "
                "pip install ninja or use --optimizer adam"
            )
        logger.info(
            "Building DeepSpeed's CPU Adam C++ op (first use on this machine, about a minute; cached afterwards in %s)",
            cpu_adam_build_dir(),
        )
    builder = CPUAdamBuilder()
    try:
        builder.load(verbose=False)
    except Exception as e:
        raise RuntimeError(
            f"--optimizer cpu_adam: building/loading DeepSpeed's CPU Adam op failed "
            f"(build folder {cpu_adam_build_dir()}): {e}"
        ) from e
    return DeepSpeedCPUAdam


def stable_source(name: str, filename: str, text: str) -> str:
    """``text`` written as ``filename`` in a folder beside torch's extension builds (rewritten only when it
    changed); the path to compile. Why: the build file records each source's path, so a source compiled from
    a checkout makes every other checkout sharing ``~/.cache/torch_extensions`` (worktrees, CI clones, a
    GPU machine's copy) rebuild the op in turn, and a build killed midway leaves a lock that later runs
    wait on. One path for one content builds once per machine."""
    from torch.utils.cpp_extension import get_default_build_root

    from toolkit.core.fileio import atomic_write

    folder = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root(), f"{name}_src")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, filename)
    if not os.path.exists(path) or open(path).read() != text:
        with atomic_write(path) as f:
            f.write(text)
    return path


def build_like_cpu_adam(
    name: str,
    sources: Sequence[str],
    include_paths: Sequence[str] = (),
    purpose: str = "",
    extra_cxx_args: Sequence[str] = (),
) -> Any:
    """Build (once per machine, cached by torch's extension loader) and import an extension of ``sources``
    with DeepSpeed's CPU Adam builder: its compiler flags (-O3, -march, OpenMP, the SIMD width) and
    include paths, so code compiled with DeepSpeed's Adam source computes exactly as DeepSpeed's op.
    Relative paths are DeepSpeed's own (``csrc/...``). One INFO line (``purpose``) while it builds.
    ``extra_cxx_args`` are added after DeepSpeed's flags (only ones that keep IEEE results, e.g. -fno-math-errno).
    """
    from deepspeed.ops.op_builder import CPUAdamBuilder

    class Builder(CPUAdamBuilder):
        def __init__(self):
            super().__init__()
            self.name = name

        def absolute_name(self) -> str:
            return f"toolkit.{name}"

        def sources(self):
            return list(sources)

        def include_paths(self):
            return list(super().include_paths()) + list(include_paths)

        def cxx_args(self):
            return list(super().cxx_args()) + list(extra_cxx_args)

    folder = os.path.join(os.path.dirname(cpu_adam_build_dir()), name)
    if not os.path.exists(os.path.join(folder, f"{name}.so")):
        logger.info(
            f"{purpose}: building {name} with DeepSpeed's CPU Adam flags (once per machine, "
            f"about as long as DeepSpeed's own op; cached in {folder})"
        )
    return Builder().load(verbose=False)
