"""Text generation: one code path for ``toolkit-generate``, ``toolkit-interactive`` and the hub."""

from toolkit.generation.config import GenerationConfig, check_generation_config
from toolkit.generation.sequence_generator import SequenceGenerator

__all__ = ["GenerationConfig", "SequenceGenerator", "check_generation_config"]
