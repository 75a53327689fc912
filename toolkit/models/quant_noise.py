"""Quant-Noise (Fan, Stock et al., 2020: https://arxiv.org/abs/2004.07320), fairseq's ``--quant-noise-pq``
and ``--quant-noise-pq-block-size``.

Training for later iterative product quantization (iPQ): in each training forward pass, the
weight of every Linear it covers is cut into blocks of ``block_size`` consecutive input
features per output row, and each block is dropped with probability ``p``; the kept blocks are
scaled by ``1 / (1 - p)`` so the expected weight is unchanged. Evaluation uses the weights as they
are. Covered, as in fairseq's transformer LM: each block's attention projections (q/k/v and out)
and FFN (fc1, fc2), and an adaptive input's projections (fairseq's AdaptiveInput leaves its
embeddings, and the adaptive softmax, without noise).

One difference, on purpose: fairseq's hook writes the masked, rescaled weight back into the
parameter (``mod.weight.data = s * weight.masked_fill(mask, 0)``), so the drops and the
``1/(1-p)`` scale accumulate in the trained weights from step to step. Here the noise is applied
to the weight used by this forward pass only (the paper's method: the gradient reaches the kept
blocks, the parameter itself is not overwritten).
"""

from __future__ import annotations

import types
from typing import Iterator, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.core.errors import UserError


def noisy_weight(weight: torch.Tensor, p: float, block_size: int) -> torch.Tensor:
    """``weight`` [out, in] with blocks of ``block_size`` input features dropped with probability p, rest scaled."""
    out_features, in_features = weight.shape
    drop = torch.empty(out_features, in_features // block_size, device=weight.device).bernoulli_(p)
    drop = drop.to(torch.bool).repeat_interleave(block_size, dim=-1)
    return weight.masked_fill(drop, 0) * (1.0 / (1.0 - p))


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = noisy_weight(self.weight, self.quant_noise_p, self.quant_noise_block) if self.training else self.weight
    return F.linear(x, weight, self.bias)


def covered_modules(model: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """The Linear modules quant-noise covers: those whose last name part the family lists in its class's
    ``QUANT_NOISE_LINEARS`` (``transformer_lm``: fairseq's choice), and an adaptive input's projections."""
    covered = getattr(type(model), "QUANT_NOISE_LINEARS", ())  # a family without the list: none of its own
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and (leaf in covered or name.startswith("embed_tokens.embeddings.")):
            yield name, module


def apply_quant_noise(model: nn.Module, p: float, block_size: int) -> int:
    """Put quant-noise on the covered modules of ``model``; the number of modules covered (0 when p is 0)."""
    if p == 0:
        return 0
    if not 0.0 < p < 1.0:
        raise UserError(f"--quant-noise-pq: a probability in [0, 1) is needed, got {p}")
    if block_size < 1:
        raise UserError(f"--quant-noise-pq-block-size must be >= 1, got {block_size}")
    count = 0
    for name, module in covered_modules(model):
        in_features = module.weight.size(1)
        if in_features % block_size:
            raise UserError(
                f"--quant-noise-pq-block-size {block_size}: {name} has {in_features} input features, "
                f"not a multiple of it (fairseq: 'Input features must be a multiple of block sizes'); "
                f"choose a block size dividing every layer's width"
            )
        module.quant_noise_p, module.quant_noise_block = p, block_size
        module.forward = types.MethodType(_linear_forward, module)
        count += 1
    return count
