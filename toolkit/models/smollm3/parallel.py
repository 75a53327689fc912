"""The tensor-parallel plan of the SmolLM3 family: the Llama family's (the same pre-norm blocks; a NoPE layer's
projections split by heads as a rotating layer's do)."""

from toolkit.models.llama.parallel import tensor_parallel_plan  # noqa: F401  (the family's plan, by its name)
