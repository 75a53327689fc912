"""The tensor-parallel plan of the OLMo 3 family: OLMo 2's (the same blocks, QK-norm over all heads as
``projection_norm``)."""

from toolkit.models.olmo2.parallel import tensor_parallel_plan  # noqa: F401  (the family's plan, by its name)
