"""Root logger setup with fairseq's line format.

2021-03-08 12:31:36 | INFO | toolkit_cli.train | message
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from toolkit.core.preflight import check_writable_file

LOG_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"

_MARK = "_toolkit_handler"  # set on the handlers installed here, so a second setup replaces them


class _ProgramErrorsPropagate:
    """A DataLoader worker's death is reported by torch's SIGCHLD handler raising ``RuntimeError("DataLoader worker
    ... is killed")`` in whatever the main process runs at that instant; when that is a log write, logging would
    print "--- Logging error ---" with a traceback and swallow it. Such an error belongs to the run, not to
    logging: it is re-raised, so the training loop reports it in its one line (``train_loop.interruption_report``)."""

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, RuntimeError) and "DataLoader worker" in str(error):
            raise error
        super().handleError(record)  # type: ignore[misc]


class StreamHandler(_ProgramErrorsPropagate, logging.StreamHandler):
    pass


class FileHandler(_ProgramErrorsPropagate, logging.FileHandler):
    pass


def make_formatter() -> logging.Formatter:
    return logging.Formatter(LOG_FORMAT, datefmt=DATE_FORMAT)


def setup_logging(log_file: Optional[str] = None, rank: int = 0) -> None:
    """Log to stdout (and ``log_file``) in fairseq's format.

    Rank 0 logs at INFO (or ``$LOGLEVEL``); other ranks only warnings and errors, and
    only rank 0 writes ``log_file``. Calling again replaces the handlers installed before.
    """
    root = logging.getLogger()
    remove_handlers()
    handler = StreamHandler(sys.stdout)
    handler.setFormatter(make_formatter())
    setattr(handler, _MARK, True)
    root.addHandler(handler)
    if rank == 0:
        root.setLevel(os.environ.get("LOGLEVEL", "INFO").upper())
        if log_file:
            add_file_handler(log_file)
    else:
        root.setLevel(logging.WARNING)


def add_file_handler(log_file: str) -> logging.Handler:
    """Append the log (fairseq's format) to ``log_file`` too; once per file."""
    root = logging.getLogger()
    path = os.path.abspath(log_file)
    for h in root.handlers:
        if getattr(h, _MARK, False) and isinstance(h, logging.FileHandler) and h.baseFilename == path:
            return h
    check_writable_file("--log-file", log_file)  # one line, not an OSError traceback (read-only fs, a folder)
    handler = FileHandler(path, mode="a", encoding="utf-8")
    handler.setFormatter(make_formatter())
    setattr(handler, _MARK, True)
    root.addHandler(handler)
    return handler


def remove_handlers() -> None:
    """Remove (and close) the handlers that :func:`setup_logging` installed."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, _MARK, False):
            root.removeHandler(h)
            h.close()
