"""MXFP4 (OCP microscaling FP4), as the gpt-oss release stores its experts: each row of a matrix [.., rows, cols]
in blocks of 32 values, each value a 4-bit FP4 E2M1 number (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1,
1.5, 2, 3, 4, 6 and their negatives), two a byte (the even column in the low nibble, the odd one in the high),
and one shared power of two per block, stored as a byte with bias 127.

Tensors: ``{name}_blocks`` uint8 [.., rows, cols / 32, 16] and ``{name}_scales`` uint8 [.., rows, cols / 32];
the matrix is [out, in] per expert (gpt-oss: ``gate_up_proj`` [E, 2F, C] with gate and up rows interleaved,
``down_proj`` [E, C, F]), the transpose of the bf16 folders' [E, in, out]. :func:`dequantize` computes what
transformers' ``convert_moe_packed_tensors`` does (before its transpose); :func:`quantize` the inverse: per block
the smallest power of two that brings the largest magnitude within 6, each value rounded to the nearest FP4
number.
"""

from __future__ import annotations

from typing import Tuple

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values sharing one scale
SCALE_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``blocks`` uint8 [.., rows, G, 16] and ``scales`` uint8 [.., rows, G] -> fp32 [.., rows, G * 32]."""
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.size(-1) != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    packed = blocks.to(torch.int64)
    values = torch.stack([table[packed & 0x0F], table[packed >> 4]], dim=-1).flatten(-2)  # [.., rows, G, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)


def quantize(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[.., rows, cols] (cols a multiple of 32) -> (blocks uint8 [.., rows, cols / 32, 16], scales uint8
    [.., rows, cols / 32]); on the meta device, their shapes only.

    A block's scale is the smallest power of two that brings its largest magnitude within 6 (rounded up, as
    transformers' and the release's quantizer), each value the nearest FP4 number (its sign bit kept: -0 too).
    A block whose values come out on the grid of twice that scale with the largest at 6 is stored at twice the
    scale (its largest 3): the one encoding of those values that this rule gives again, so a dequantized MXFP4
    matrix quantizes to its own bytes (a block of the release with its largest at 3 included)."""
    *lead, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"MXFP4: {cols} columns are not a whole number of blocks of {BLOCK}")
    groups = cols // BLOCK
    if weight.is_meta:
        return (
            torch.empty(*lead, groups, BLOCK // 2, dtype=torch.uint8, device="meta"),
            torch.empty(*lead, groups, dtype=torch.uint8, device="meta"),
        )
    x = weight.detach().float().reshape(*lead, groups, BLOCK)
    largest = x.abs().amax(-1)
    mantissa, power = torch.frexp(largest / 6.0)  # largest / 6 = mantissa * 2^power, mantissa in [0.5, 1)
    exponent = torch.where(largest > 0, power - (mantissa == 0.5).int(), -SCALE_BIAS)  # ceil(log2(largest / 6))
    exponent = exponent.clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = x / torch.exp2(exponent.float()).unsqueeze(-1)
    magnitudes = torch.tensor(FP4_VALUES[:8], dtype=torch.float32, device=x.device)
    index = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)  # the nearest magnitude (ties: the lower)
    odd = (index == 1) | (index == 3)  # 0.5 and 1.5: off the grid of twice the scale
    coarser = (index.amax(-1) == 7) & ~odd.any(-1) & (exponent < SCALE_BIAS)
    halved = torch.tensor([0, 0, 1, 0, 2, 3, 4, 5], device=x.device)  # the index of each even magnitude's half
    index = torch.where(coarser.unsqueeze(-1), halved[index], index)
    codes = (index + 8 * torch.signbit(x).long()).to(torch.uint8)
    pairs = codes.view(*lead, groups, BLOCK // 2, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (exponent + coarser.int() + SCALE_BIAS).to(torch.uint8)
