"""Progress of long work in steps or items: a tqdm bar on a terminal, periodic log lines otherwise.

A command whose output goes to a log file still says where it is (``[3/5] writing ...``).
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

logger = logging.getLogger("toolkit.progress")


class StepProgress:
    """``advance(message)`` after each of ``total`` steps: a tqdm bar on a terminal, else a log line."""

    def __init__(self, total: int, desc: str, use_tqdm: Optional[bool] = None, logger_name: str = "toolkit.export"):
        self.total, self.done, self.desc, self.logger_name = total, 0, desc, logger_name
        if use_tqdm is None:
            use_tqdm = sys.stderr.isatty()
        self.bar = None
        if use_tqdm:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)

    def advance(self, message: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(message, refresh=False)
            self.bar.update(1)
        logging.getLogger(self.logger_name).log(
            logging.DEBUG if self.bar is not None else logging.INFO, f"{self.desc} [{self.done}/{self.total}] {message}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False
