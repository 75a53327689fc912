"""The parallelism plan of the GLM-4.5 family: its block is the MoE family's (grouped-query attention split by
heads, QK-norm per head, the experts in the plan's expert slot, ``ep_shard``), so the plan is that family's; a
dense first layer's MLP and the shared experts stay whole on every tensor-parallel rank, as in the DeepSeek-V3
family."""

from __future__ import annotations

from toolkit.models.moe.parallel import tensor_parallel_plan

__all__ = ["tensor_parallel_plan"]
