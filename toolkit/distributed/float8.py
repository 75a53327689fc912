"""``--fp8``: float8 training of the blocks' Linear layers through torchao (torchtitan's Float8 converter).

Why only the blocks: their Linear layers (q/k/v, output, feed-forward) carry almost all the
matmul FLOPs, and the rest is where float8's error costs most: the embedding, the
input/output projections and the output (vocabulary) projection stay in the run's
precision, as torchtitan and OLMo keep the output layer out of float8.

What it does: each ``nn.Linear`` inside ``model.layers`` (both dimensions divisible by 16,
as the float8 matmul requires) is swapped for torchao's ``Float8Linear`` on the meta
device, before activation checkpointing, ``--compile`` and FSDP2 (torchtitan's order).
Parameter names and state-dict keys do not change (the weight stays a high-precision
parameter; only the matmul casts), so checkpoints move freely between float8 and bf16 runs.

Under ``--pipeline-parallel-size`` each rank converts the blocks of its stages. The scales are taken over
what a matmul sees, a micro-batch: the rowwise scales of the weights' gradients (per column of the operands,
over the tokens), and every tensorwise scale, differ from one process's over the whole batch, so a pipelined
float8 run follows one process within float8's precision, not bit for bit.

Recipes (``--fp8-recipe``): ``rowwise`` (default; a scale per row of each operand, the more
accurate one, torchtitan's recommendation) or ``tensorwise`` (one scale per tensor, faster).
``--fp8-all-gather`` casts the weights to float8 before FSDP2's all-gather (half the bytes of
bf16); torchao supports it with ``tensorwise`` only, and then the per-tensor scales of all
weights are computed in one fused pass after each optimizer step (``after_optimizer_step``).

torchao is an optional extra: without it ``--fp8`` is one line naming the install.
Float8 matmuls need a GPU of compute capability 8.9 or newer (H100, L4, RTX 4090); on CPU
torch emulates them (correct, slow: useful for tests, not for speed).
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional

import torch

from toolkit.core.errors import UserError

logger = logging.getLogger(__name__)

FP8_RECIPES = ("rowwise", "tensorwise")
MIN_CAPABILITY = (8, 9)
INSTALL_HINT = "--fp8 needs torchao (float8 training); install it with: pip install torchao"


def _torchao_float8():
    """``torchao.float8``; its import's warnings (kernels this machine cannot load, CUDA-only ones on a
    CPU machine, which float8 training does not use; a torch deprecation) are kept off the run's log."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [each.level for each in quiet]
    for each in quiet:
        each.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise UserError(f"{INSTALL_HINT} ({e})") from None
    finally:
        for each, level in zip(quiet, levels):
            each.setLevel(level)
    return float8


def check_fp8_device(device: torch.device) -> None:
    """Refuse a GPU without float8 matmuls (before any model is built)."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise UserError(
            f"--fp8: {torch.cuda.get_device_name(device)} (compute capability "
            f"{capability[0]}.{capability[1]}) has no float8 matmuls; they need 8.9 or newer "
            f"(H100, L4, RTX 4090); drop --fp8"
        )


def float8_config(recipe: str, all_gather: bool):
    """torchao's ``Float8LinearConfig`` for ``--fp8-recipe`` / ``--fp8-all-gather``."""
    float8 = _torchao_float8()
    if recipe not in FP8_RECIPES:
        raise UserError(f"--fp8-recipe {recipe}: choose from {', '.join(FP8_RECIPES)}")
    if all_gather and recipe != "tensorwise":
        raise UserError(
            "--fp8-all-gather: torchao casts weights to float8 before FSDP2's all-gather only with "
            "--fp8-recipe tensorwise; add it, or drop --fp8-all-gather"
        )
    if recipe == "rowwise":
        return float8.Float8LinearConfig.from_recipe_name("rowwise")
    return float8.Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather)


def _block_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """Every module inside the blocks this rank holds (a pipeline stage's model keeps empty slots for the others')."""
    return [m for block in model.layers if block is not None for m in block.modules()]


def _in_blocks_and_aligned(model: torch.nn.Module) -> Callable[[torch.nn.Module, str], bool]:
    """The module filter: Linear layers inside ``model.layers`` whose dimensions the float8 matmul takes."""
    blocks = {id(m) for m in _block_modules(model)}

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        return (
            isinstance(module, torch.nn.Linear)
            and id(module) in blocks
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )

    return keep


def apply_float8(model: torch.nn.Module, recipe: str = "rowwise", all_gather: bool = False) -> int:
    """Swap the blocks' Linear layers for ``Float8Linear`` in place; returns how many were swapped."""
    float8 = _torchao_float8()
    config = float8_config(recipe, all_gather)
    keep = _in_blocks_and_aligned(model)
    candidates = sum(isinstance(m, torch.nn.Linear) for m in _block_modules(model))
    float8.convert_to_float8_training(model, config=config, module_filter_fn=keep)
    swapped = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    if swapped == 0:
        raise UserError(
            "--fp8: no Linear layer of the model's blocks has both dimensions divisible by 16, so "
            "nothing would train in float8; drop --fp8"
        )
    skipped = candidates - swapped
    logger.info(
        f"--fp8: {swapped} Linear layers of the blocks train in float8 ({recipe} scaling"
        f"{', float8 all-gather' if all_gather else ''}); embeddings and the output projection stay in "
        f"the run's precision" + (f"; {skipped} left out (a dimension not divisible by 16)" if skipped else "")
    )
    return swapped


def float8_matmul(
    module: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """``Float8Linear.forward`` on given (local) weights: tensor parallelism's column-parallel layers compute
    their rank's output features from the local shard, in float8 with the module's torchao config."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    out = matmul_with_hp_or_float8_args.apply(x, weight.t(), module.linear_mm_config, module.config)
    return out + bias.to(out.dtype) if bias is not None else out


def after_optimizer_step(model: torch.nn.Module, all_gather: bool) -> Optional[Callable[[], None]]:
    """What the trainer calls after each optimizer step, or None (only float8 all-gather needs it):
    the per-tensor float8 scales of the sharded weights, for the next all-gather, in one fused pass."""
    if not all_gather:
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return lambda: precompute_float8_dynamic_scale_for_fsdp(model)
