"""Models and their named architectures (``--arch``); no sharding code in here.

The one way to turn an architecture name into a model, whoever asks (training, the
task, evaluation, the hub, parameter counts):

``build_model(arch, options, task)``     options (a dataclass, dict or namespace) over the arch's values
``build_for_loading(arch, options, task, device)``  the same, memory allocated but not initialized (weights follow)
``model_config(arch, **overrides)``      the options dataclass with the arch's values, then yours
``count_parameters(arch, ...)``          its parameter count, built on the meta device (no memory)
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Dict, Tuple

from toolkit.config import options
from toolkit.core import registry
from toolkit.models.fairseq_model import FAIRSEQ_NAMES

if TYPE_CHECKING:
    import torch


def _values(section: Any) -> Dict[str, Any]:
    if section is None:
        return {}
    if isinstance(section, dict):
        return section
    if dataclasses.is_dataclass(section):
        return dataclasses.asdict(section)
    return vars(section)


def model_config(arch: str, **overrides: Any):
    """The model options of a named architecture, with ``overrides`` applied on top (as user flags are)."""
    registry.import_submodules("toolkit.models")
    entry = registry.resolve_arch(arch)
    if entry.config is None:
        raise ValueError(f"--arch {arch}: model takes no options")
    unknown = set(overrides) - {f.name for f in dataclasses.fields(entry.config)}
    if unknown:
        raise TypeError(f"{arch}: unknown model options {sorted(unknown)}")
    return entry.config(**options.architecture_defaults(arch, overrides))


def build_model(arch: str, section: Any, task) -> torch.nn.Module:
    """The model of ``arch`` for ``task``; options in ``section`` win over the architecture's values.

    Built in the caller's default device (``with torch.device("meta")`` for a model that is
    sharded and initialized afterwards).
    """
    if registry.registered_arch(arch) is None:
        registry.import_all_components()
    entry = registry.resolve_arch(arch)
    if entry.config is None:
        return entry.cls.build_model(section, task)
    names = {f.name for f in dataclasses.fields(entry.config)}
    given = {k: v for k, v in _values(section).items() if k in names}
    return entry.cls.build_model(entry.config(**options.architecture_defaults(arch, given)), task)


def build_for_loading(arch: str, section: Any, task, device: torch.device) -> torch.nn.Module:
    """``build_model`` for a checkpoint's weights (eval-lm, the hub, the in-training evaluation): built on the
    meta device, allocated on ``device`` without drawing initial values, computed buffers set."""
    import torch  # here, not at the top: the families' options and sizes (this package) are read by --help

    with torch.device("meta"):
        model = build_model(arch, section, task)
    model.to_empty(device=device)
    model.reset_buffers()  # computed buffers; every parameter comes from the checkpoint next
    return model


def count_params(model: torch.nn.Module) -> Tuple[int, int]:
    """(all, trained) parameters of a built model, tied ones once."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


class _CountingDictionary:
    def __init__(self, size: int, pad: int):
        self.size, self.pad_index = size, pad

    def __len__(self) -> int:
        return self.size

    def pad(self) -> int:
        return self.pad_index


def build_on_meta(
    arch: str, vocab_size: int = 50257, tokens_per_sample: int = 2048, padding_idx: int = 1, **overrides: Any
) -> torch.nn.Module:
    """Any registered architecture, built on the meta device (shapes only, no memory, no init)."""
    import torch

    task = SimpleNamespace(
        dictionary=_CountingDictionary(vocab_size, padding_idx),
        cfg=SimpleNamespace(tokens_per_sample=tokens_per_sample),
    )
    with torch.device("meta"):
        return build_model(arch, model_config(arch, **overrides), task)


def count_parameters(arch: str, vocab_size: int = 50257, tokens_per_sample: int = 2048, **overrides: Any) -> int:
    """Number of parameters (tied ones once) of a named architecture, e.g. ~175e9 for transformer_lm_gpt3_175."""
    return count_params(build_on_meta(arch, vocab_size, tokens_per_sample, **overrides))[0]


# fairseq's names, so a plugin's ``from fairseq.models import ...`` ports by renaming the import
# (toolkit.models.fairseq_model; docs/plugins.md). Reached at first use: they need torch, the families'
# options and sizes (read by --help) do not.
__getattr__ = registry.fairseq_plugin_getattr(__name__, FAIRSEQ_NAMES)
