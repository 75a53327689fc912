"""Dynamic loss scaling for fp16 training, with fairseq's semantics.

Flow per update (the trainer drives it, as fairseq's FP16Optimizer does)::

    scaler.scale(loss).backward()
    grad_norm = <global grad norm of the scaled gradients, all-reduced across ranks>
    try:
        scaler.check_overflow(grad_norm)      # raises OverflowError after lowering the scale
    except OverflowError as e:
        logger.info(overflow_message(scaler.loss_scale))   # skip this update
    else:
        optimizer.step()
        scaler.update()                      # doubles after ``scale_window`` clean updates

The scaler is process-local: every rank must see the same ``grad_norm`` (the
trainer all-reduces it) so that all ranks take the same decision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

OVERFLOW_LOG_FORMAT = "NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: {scale}"
MIN_SCALE_MESSAGE = (
    "Minimum loss scale reached ({}). Your loss is probably exploding. "
    "Try lowering the learning rate, using gradient clipping or increasing the batch size."
)

if TYPE_CHECKING:
    from toolkit.config import CommonConfig


def overflow_message(loss_scale: float) -> str:
    """fairseq's log line for a skipped update."""
    return OVERFLOW_LOG_FORMAT.format(scale=loss_scale)


def default_scale_window(world_size: int, update_freq: int) -> int:
    """fairseq's default ``--fp16-scale-window``: 2**14 / (data-parallel size * update freq)."""
    return int(2**14 / max(1, world_size) / max(1, update_freq))


class DynamicLossScaler:
    """Scale the loss up so fp16 gradients do not underflow; back off when they overflow.

    * ``update()`` after every successful update: after ``scale_window`` updates
      without an overflow the scale is multiplied by ``scale_factor``.
    * ``check_overflow(grad_norm)``: on inf/NaN, divide the scale by
      ``scale_factor`` (only once the share of overflowing updates since the last
      rescale reaches ``tolerance``; never below ``threshold`` when given — fairseq's
      ``--threshold-loss-scale`` floors the scale) and raise ``OverflowError``.
      If the scale would fall to ``min_loss_scale`` or below, the scale is left as
      it was and ``FloatingPointError`` is raised instead (stop training).
    """

    def __init__(
        self,
        init_scale: float = 2.0**7,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        tolerance: float = 0.0,
        threshold: Optional[float] = None,
        min_loss_scale: float = 1e-4,
    ):
        if scale_window <= 0:
            raise ValueError(f"scale_window must be positive, got {scale_window}")
        self.loss_scale = float(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.tolerance = float(tolerance)
        self.threshold = threshold
        self.min_loss_scale = float(min_loss_scale)
        self._iter = 0
        self._last_overflow_iter = -1
        self._last_rescale_iter = -1
        self._overflows_since_rescale = 0

    @classmethod
    def from_config(cls, common: CommonConfig, world_size: int, update_freq: int) -> DynamicLossScaler:
        """Build from the ``--fp16-*`` flags; the scale window defaults to fairseq's 2**14 / (W * update_freq)."""
        window = common.fp16_scale_window or default_scale_window(world_size, update_freq)
        return cls(
            init_scale=common.fp16_init_scale,
            scale_window=window,
            tolerance=common.fp16_scale_tolerance,
            threshold=common.threshold_loss_scale,
            min_loss_scale=common.min_loss_scale,
        )

    def scale(self, outputs):
        return self.loss_scale * outputs

    def update(self) -> None:
        """Call after each update that was applied (no overflow)."""
        if (self._iter - self._last_overflow_iter) % self.scale_window == 0:
            self.loss_scale *= self.scale_factor
            self._last_rescale_iter = self._iter
        self._iter += 1

    def _decrease_loss_scale(self) -> None:
        self.loss_scale /= self.scale_factor
        if self.threshold is not None:
            self.loss_scale = max(self.loss_scale, self.threshold)

    @staticmethod
    def has_overflow(grad_norm: Optional[float]) -> bool:
        if grad_norm is None:
            return False
        grad_norm = float(grad_norm)
        return grad_norm == float("inf") or grad_norm == float("-inf") or grad_norm != grad_norm

    def check_overflow(self, grad_norm: Optional[float] = None, overflow: bool = False) -> None:
        """Raise ``OverflowError`` (scale lowered) if ``grad_norm`` is inf/NaN or ``overflow`` is set."""
        if not (overflow or self.has_overflow(grad_norm)):
            return
        prev_scale = self.loss_scale
        iter_since_rescale = self._iter - self._last_rescale_iter
        if iter_since_rescale == 0:
            iter_since_rescale = 1000  # as fairseq: an overflow right at a rescale counts little
        self._last_overflow_iter = self._iter
        self._overflows_since_rescale += 1
        pct_overflow = self._overflows_since_rescale / float(iter_since_rescale)
        if pct_overflow >= self.tolerance:
            self._decrease_loss_scale()
            self._last_rescale_iter = self._iter
            self._overflows_since_rescale = 0

        if self.loss_scale <= self.min_loss_scale:
            # FloatingPointError: uncommon enough that the trainer can catch it to stop training.
            self.loss_scale = prev_scale
            raise FloatingPointError(MIN_SCALE_MESSAGE.format(self.min_loss_scale))

        self._iter += 1
        raise OverflowError("setting loss scale to: " + str(self.loss_scale))

    def state_dict(self) -> Dict[str, Any]:
        # fairseq saves only "loss_scale"; the counters make a resumed run continue identically.
        return {
            "loss_scale": self.loss_scale,
            "iter": self._iter,
            "last_overflow_iter": self._last_overflow_iter,
            "last_rescale_iter": self._last_rescale_iter,
            "overflows_since_rescale": self._overflows_since_rescale,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.loss_scale = float(state_dict["loss_scale"])
        self._iter = int(state_dict.get("iter", self._iter))
        self._last_overflow_iter = int(state_dict.get("last_overflow_iter", self._last_overflow_iter))
        self._last_rescale_iter = int(state_dict.get("last_rescale_iter", self._last_rescale_iter))
        self._overflows_since_rescale = int(state_dict.get("overflows_since_rescale", self._overflows_since_rescale))
