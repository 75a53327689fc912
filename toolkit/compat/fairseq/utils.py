"""The handful of ``fairseq.utils`` functions that scripts and plugins call, with fairseq's semantics.

Why: a fairseq script's ``from fairseq import utils`` ports by renaming the import to
``from toolkit import utils``; these are the functions such code uses (sample movement,
padding, incremental state, ``--user-dir``), not a copy of the whole module.
"""

from __future__ import annotations

import ast
import collections
import logging
import math
import os
from typing import Any, Callable, List, Optional

import torch
import torch.nn.functional as F

from toolkit.core import registry
from toolkit.models.common.mlp import activation as activation_named

logger = logging.getLogger(__name__)


def split_paths(paths: str, separator: str = os.pathsep) -> List[str]:
    """``a:b`` -> ``["a", "b"]`` (fairseq's ensemble and data paths)."""
    return paths.split(separator) if "://" not in paths else paths.split("|")


def apply_to_sample(f: Callable[[torch.Tensor], Any], sample: Any) -> Any:
    """``f`` applied to every tensor inside nested dicts, lists, tuples and sets; other values kept."""
    if hasattr(sample, "__len__") and len(sample) == 0:
        return {}

    def _apply(x: Any) -> Any:
        if torch.is_tensor(x):
            return f(x)
        if isinstance(x, collections.OrderedDict):  # keeps its attributes, as fairseq's
            od = collections.OrderedDict((key, _apply(value)) for key, value in x.items())
            od.__dict__ = x.__dict__
            return od
        if isinstance(x, dict):
            return {key: _apply(value) for key, value in x.items()}
        if isinstance(x, list):
            return [_apply(v) for v in x]
        if isinstance(x, tuple):
            return tuple(_apply(v) for v in x)
        if isinstance(x, set):
            return {_apply(v) for v in x}
        return x

    return _apply(sample)


def move_to_cuda(sample: Any, device: Optional[torch.device] = None) -> Any:
    device = device or torch.cuda.current_device()
    return apply_to_sample(lambda t: t.to(device=device, non_blocking=True), sample)


def move_to_cpu(sample: Any) -> Any:
    """Tensors to the CPU; fp16/bf16 ones as fp32 (fairseq's: half precision is poorly supported on CPU)."""

    def _to_cpu(t: torch.Tensor) -> torch.Tensor:
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.to(dtype=torch.float32)
        return t.cpu()

    return apply_to_sample(_to_cpu, sample)


def get_incremental_state(module, incremental_state, key: str):
    """``module``'s cached value ``key`` in a decoder's incremental state (None at the first step)."""
    return module.get_incremental_state(incremental_state, key)


def set_incremental_state(module, incremental_state, key: str, value):
    if incremental_state is not None:
        result = module.set_incremental_state(incremental_state, key, value)
        if result is not None:
            incremental_state = result
    return incremental_state


def make_positions(tensor: torch.Tensor, padding_idx: int, onnx_trace: bool = False) -> torch.Tensor:
    """Position numbers of non-pad symbols, from ``padding_idx + 1``; pads get ``padding_idx``."""
    mask = tensor.ne(padding_idx).int()
    return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + padding_idx


def strip_pad(tensor: torch.Tensor, pad: int) -> torch.Tensor:
    return tensor[tensor.ne(pad)]


def convert_padding_direction(
    src_tokens: torch.Tensor, padding_idx: int, right_to_left: bool = False, left_to_right: bool = False
) -> torch.Tensor:
    """Move each row's padding to the other side (exactly one direction must be asked)."""
    assert right_to_left ^ left_to_right
    pad_mask = src_tokens.eq(padding_idx)
    if (
        not pad_mask.any()
        or (left_to_right and not pad_mask[:, 0].any())
        or (right_to_left and not pad_mask[:, -1].any())
    ):
        return src_tokens
    max_len = src_tokens.size(1)
    positions = torch.arange(max_len, device=src_tokens.device).expand_as(src_tokens)
    num_pads = pad_mask.long().sum(dim=1, keepdim=True)
    index = torch.remainder(positions - num_pads if right_to_left else positions + num_pads, max_len)
    return src_tokens.gather(1, index)


def item(tensor: Any) -> Any:
    """A Python number from a 0-dim tensor (or the value itself)."""
    if hasattr(tensor, "item"):
        return tensor.item()
    if hasattr(tensor, "__getitem__"):
        return tensor[0]
    return tensor


def resolve_max_positions(*args: Any) -> Any:
    """The smallest of several max-positions limits (None: no limit; tuples element-wise)."""

    def smaller(a: Any, b: Any) -> Any:
        if a is None:
            return b
        if b is None:
            return a
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return min(a, b)
        if isinstance(a, (int, float)):
            a = (a,) * len(b)
        if isinstance(b, (int, float)):
            b = (b,) * len(a)
        return tuple(smaller(x, y) for x, y in zip(a, b))

    result = None
    for arg in args:
        result = smaller(result, arg)
    return result


def import_user_module(args: Any) -> None:
    """``--user-dir``: import the plugin folder ``args.user_dir`` once, so its components register."""
    user_dir = args if isinstance(args, str) else vars(args).get("user_dir")
    if user_dir is not None:
        registry.import_user_module(user_dir)


def softmax(x: torch.Tensor, dim: int, onnx_trace: bool = False) -> torch.Tensor:
    return F.softmax(x.float(), dim=dim)


def log_softmax(x: torch.Tensor, dim: int, onnx_trace: bool = False) -> torch.Tensor:
    return F.log_softmax(x.float(), dim=dim)


def get_perplexity(loss: Optional[float], round: int = 2, base: float = 2) -> float:  # noqa: A002 (fairseq's name)
    if loss is None:
        return 0.0
    try:
        return float(f"{base**loss:.{round}f}") if math.isfinite(base**loss) else float("inf")
    except OverflowError:
        return float("inf")


def eval_str_list(x: Any, type: Callable = float) -> Optional[list]:  # noqa: A002 (fairseq's name)
    """``"[1, 2]"`` or ``"1,2"`` -> ``[1.0, 2.0]`` (a literal, never evaluated as code)."""
    if x is None:
        return None
    if isinstance(x, str):
        x = ast.literal_eval(x)
    try:
        return list(map(type, x))
    except TypeError:
        return [type(x)]


def set_torch_seed(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)


def get_activation_fn(activation: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """fairseq's activation names (``relu``, ``gelu``, ``gelu_accurate``, ``tanh``, ``linear``, ``swish``): the
    models' one table (``toolkit.models.common.mlp.ACTIVATIONS``)."""
    return activation_named(activation)
