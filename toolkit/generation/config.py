"""Generation options, declared once with fairseq's names, defaults and meanings.

``toolkit-generate``, ``toolkit-interactive`` and the hub's ``generate``/``sample``
all build a :class:`~toolkit.generation.sequence_generator.SequenceGenerator` from this.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from toolkit.config import opt
from toolkit.core.errors import UserError


@dataclass
class GenerationConfig:
    beam: int = opt(5, "beam size (with --sampling: the number of samples per prompt)")
    nbest: int = opt(1, "number of hypotheses to output")
    max_len_a: float = opt(0.0, "generate sequences of maximum length ax + b, where x is the source length "
                                "(for a language model: the prompt length + 1)")
    max_len_b: int = opt(200, "generate sequences of maximum length ax + b, where x is the source length")
    min_len: int = opt(1, "minimum generation length")
    lenpen: float = opt(1.0, "length penalty: <1.0 favors shorter, >1.0 favors longer sentences")
    unkpen: float = opt(0.0, "unknown word penalty: <0 produces more unks, >0 produces fewer")
    unnormalized: bool = opt(False, "compare unnormalized hypothesis scores")
    no_repeat_ngram_size: int = opt(0, "ngram blocking such that this size ngram cannot be repeated in the "
                                       "generation")
    sampling: bool = opt(False, "sample hypotheses instead of using beam search")
    sampling_topk: int = opt(-1, "sample from top K likely next words instead of all words")
    sampling_topp: float = opt(-1.0, "sample from the smallest set whose cumulative probability mass exceeds p "
                                     "for next words")
    temperature: float = opt(1.0, "temperature for generation")
    prefix_size: int = opt(0, "initialize generation by target prefix of given length")
    max_new_tokens: Optional[int] = opt(None, "stop after this many tokens past the prompt (the hub's max_len)",
                                        cli=False)


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
