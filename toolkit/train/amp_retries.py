"""fairseq's ``--amp-batch-retries``: under ``--amp``, an update whose gradients overflow is retried on the
same batch (with the loss scale the overflow just lowered) up to N times before the batch is skipped.

Without retries an overflow costs the batch (as ``--fp16`` does, in fairseq and here). fairseq
retries by calling ``train_step`` again from inside itself; :meth:`AmpBatchRetries.after_overflow`
does the same. One difference: fairseq resets its retry counter only when it skips a batch, so
retries used on earlier batches that then succeeded count against later ones; here the counter
is per batch, as the flag's help ("number of retries of same batch") says.

Retries need loss scaling: ``--amp`` is the ``--fp16`` path on a GPU (toolkit.compat.fairseq.flags);
on CPU it runs fp32, nothing overflows, and the flag has no effect (one INFO line says so).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, TypeVar

from toolkit.config import CommonConfig

logger = logging.getLogger("toolkit.amp_retries")  # the logger name log lines and filters already use

T = TypeVar("T")


class AmpBatchRetries:
    def __init__(self, retries: int):
        self.retries = max(0, retries)
        self.used = 0  # retries spent on the batch being trained

    @classmethod
    def from_config(cls, common: CommonConfig) -> AmpBatchRetries:
        """Retries under --amp with loss scaling (fp16); none otherwise (plain --fp16 skips, as fairseq)."""
        return cls(common.amp_batch_retries if common.amp and common.fp16 else 0)

    def after_overflow(self, retry: Callable[[], Optional[T]]) -> Optional[T]:
        """The result of training the same batch again, or None (skip it) once the retries are spent."""
        if self.used >= self.retries:
            if self.retries:
                logger.info("AMP: skipping this batch.")
            self.used = 0
            return None
        self.used += 1
        logger.info(f"AMP: retrying this batch ({self.used} of {self.retries})")
        try:
            return retry()
        finally:
            self.used = 0  # the batch is done (trained or skipped) once the outermost retry returns
