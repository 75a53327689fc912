"""Generation options, declared once with fairseq's names, defaults and meanings.

``toolkit-generate``, ``toolkit-interactive`` and the hub's ``generate``/``sample``
all build a :class:`~toolkit.generation.sequence_generator.SequenceGenerator` from this.
"""

from __future__ import annotations

from toolkit.core.errors import UserError
from toolkit.config.commands import GenerationConfig  # noqa: F401  (torch-free for --help)


def check_generation_config(cfg: GenerationConfig) -> None:
    """fairseq's preconditions, as one-line errors naming the flag."""
    if cfg.beam < 1:
        raise UserError(f"--beam {cfg.beam}: must be at least 1")
    if cfg.nbest < 1 or cfg.nbest > cfg.beam:
        raise UserError(f"--nbest {cfg.nbest}: must be between 1 and --beam ({cfg.beam})")
    if cfg.temperature <= 0:
        raise UserError(f"--temperature {cfg.temperature}: must be greater than 0")
    if not cfg.sampling and (cfg.sampling_topk > 0 or cfg.sampling_topp > 0):
        which = "--sampling-topk" if cfg.sampling_topk > 0 else "--sampling-topp"
        raise UserError(f"{which} requires --sampling")
    if cfg.sampling_topp > 1:
        raise UserError(f"--sampling-topp {cfg.sampling_topp}: a probability mass, at most 1")
    if cfg.min_len < 0 or cfg.no_repeat_ngram_size < 0:
        raise UserError("--min-len and --no-repeat-ngram-size must not be negative")
