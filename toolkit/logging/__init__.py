"""Logging: fairseq-format log lines, meters/metrics aggregation, progress bars, TensorBoard, MFU.

    from toolkit.logging import metrics, progress_bar, setup_logging, throughput
"""
from . import meters, metrics, progress_bar, throughput  # noqa: F401
from .progress_bar import build_progress_bar, format_stat  # noqa: F401
from .setup import DATE_FORMAT, LOG_FORMAT, add_file_handler, remove_handlers, setup_logging  # noqa: F401

__all__ = ["meters", "metrics", "progress_bar", "throughput", "setup_logging", "add_file_handler",
           "remove_handlers", "build_progress_bar", "format_stat", "LOG_FORMAT", "DATE_FORMAT"]
