"""Models and their named architectures (``--arch``); no sharding code in here.

Helpers for any registered architecture:
``model_config(arch, **overrides)`` the options dataclass with the arch's values, then yours;
``count_parameters(arch, ...)`` its parameter count, built on the meta device (no memory).
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch


def model_config(arch: str, **overrides: Any):
    """The model options of a named architecture, with ``overrides`` applied on top (as user flags are)."""
    from toolkit import options, registry

    registry.import_submodules("toolkit.models")
    entry = registry.resolve_arch(arch)
    if entry.config is None:
        raise ValueError(f"--arch {arch}: model takes no options")
    unknown = set(overrides) - {f.name for f in dataclasses.fields(entry.config)}
    if unknown:
        raise TypeError(f"{arch}: unknown model options {sorted(unknown)}")
    return entry.config(**options.architecture_defaults(arch, overrides))


class _CountingDictionary:
    def __init__(self, size: int, pad: int):
        self.size, self.pad_index = size, pad

    def __len__(self) -> int:
        return self.size

    def pad(self) -> int:
        return self.pad_index


def build_on_meta(arch: str, vocab_size: int = 50257, tokens_per_sample: int = 2048, padding_idx: int = 1,
                  **overrides: Any) -> torch.nn.Module:
    """Any registered architecture, built on the meta device (shapes only, no memory, no init)."""
    from toolkit import registry

    cfg = model_config(arch, **overrides)
    task = SimpleNamespace(dictionary=_CountingDictionary(vocab_size, padding_idx),
                           cfg=SimpleNamespace(tokens_per_sample=tokens_per_sample))
    with torch.device("meta"):
        return registry.resolve_arch(arch).cls.build_model(cfg, task)


def count_parameters(arch: str, vocab_size: int = 50257, tokens_per_sample: int = 2048, **overrides: Any) -> int:
    """Number of parameters (tied ones once) of a named architecture, e.g. ~175e9 for transformer_lm_gpt3_175."""
    model = build_on_meta(arch, vocab_size, tokens_per_sample, **overrides)
    return sum(p.numel() for p in model.parameters())
