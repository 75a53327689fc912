"""Logging: fairseq-format log lines, meters/metrics aggregation, progress bars, TensorBoard, MFU.

    from toolkit.logging import metrics, progress_bar, setup_logging, throughput

Only ``setup`` (the root logger's format, torch-free) is imported with the package; the meters, metrics,
progress bars and throughput need torch and come in at their first use, so a command can set up its log
before it imports torch (toolkit-hydra-train composes its config, and reports a bad one, torch-free).
"""

import importlib
from typing import Any

from .setup import DATE_FORMAT, LOG_FORMAT, add_file_handler, remove_handlers, setup_logging  # noqa: F401

_SUBMODULES = ("meters", "metrics", "progress_bar", "throughput")
_PROGRESS_BAR_NAMES = ("build_progress_bar", "format_stat")

__all__ = [
    "meters",
    "metrics",
    "progress_bar",
    "throughput",
    "setup_logging",
    "add_file_handler",
    "remove_handlers",
    "build_progress_bar",
    "format_stat",
    "LOG_FORMAT",
    "DATE_FORMAT",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"toolkit.logging.{name}")
    if name in _PROGRESS_BAR_NAMES:
        return getattr(importlib.import_module("toolkit.logging.progress_bar"), name)
    raise AttributeError(f"module 'toolkit.logging' has no attribute '{name}'")
