"""RMSNorm: x / sqrt(mean(x^2) + eps), times a learned scale per channel (or ``1 + scale``, Gemma's).

A block takes its norm as a constructor (``common/blocks.py``), so a family with LayerNorm passes torch's
``nn.LayerNorm`` (fairseq's and GPT-NeoX's LayerNorm); RMSNorm is written here for the fp32 reduction and the
order of the cast and the scale that each family's checkpoints were trained with (below).
"""

from __future__ import annotations

import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    """Reduced in fp32 whatever the input dtype, as Hugging Face's.

    ``unit_offset``: the scale is ``1 + weight`` (Gemma), so a weight of 0 is the identity; the product is
    taken in fp32 and then cast (Gemma's order). Without it the normalized input is cast first and then
    scaled by ``weight`` (Llama's order): the two orders round differently in bf16, and each family's
    checkpoints were trained with its own.
    """

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.empty(dim))

    def mean_square(self, x32: torch.Tensor) -> torch.Tensor:
        """The mean of the squares over the last dim, [..., 1]: a tensor-parallel split of that dim over ranks
        (``projection_norm`` in ``toolkit.distributed.tensor_parallel``) sums the ranks' parts instead."""
        return x32.pow(2).mean(-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(self.mean_square(x32) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * normed.to(x.dtype)
