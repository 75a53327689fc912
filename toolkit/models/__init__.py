"""Models and their named architectures (``--arch``); no sharding code in here.

The one way to turn an architecture name into a model, whoever asks (training, the
task, evaluation, the hub, parameter counts):

``build_model(arch, options, task)``     options (a dataclass, dict or namespace) over the arch's values
``build_for_loading(arch, options, task, device)``  the same, memory allocated but not initialized (weights follow)
``model_config(arch, **overrides)``      the options dataclass with the arch's values, then yours
``count_parameters(arch, ...)``          its parameter count, built on the meta device (no memory)
``matching_arch(family, given)``         the named size of a family with these options (an import's --arch)

A family is a folder ``toolkit/models/<name>/`` (``config.py`` its options, ``archs.py`` its named sizes,
``model.py`` its model from ``common/``'s blocks, ``parallel.py`` its tensor-parallel plan, ``hf.py`` its
Hugging Face adapter) registered by one line, ``toolkit.core.registry.BUILTIN_FAMILIES``.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence, Tuple

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
    registry.declare_builtin_components()
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


def parameter_breakdown(model: torch.nn.Module) -> Dict[str, int]:
    """Parameters by top-level part (tied ones once, under their first holder), then other, total."""
    seen, parts = set(), {}
    for part, module in model.named_children():
        fresh = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        parts[part] = sum(p.numel() for p in fresh)
    total = sum(p.numel() for p in model.parameters())
    parts["other"] = total - sum(parts.values())  # the model's own parameters, outside any part
    parts["total"] = total
    return parts


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


def count_parameters(
    arch: str, vocab_size: int = 50257, tokens_per_sample: int = 2048, verbose: bool = False, **overrides: Any
) -> int:
    """Number of parameters (tied ones once) of a named architecture, e.g. ~175e9 for transformer_lm_gpt3_175;
    ``verbose`` prints them by part (:func:`parameter_breakdown`)."""
    parts = parameter_breakdown(build_on_meta(arch, vocab_size, tokens_per_sample, **overrides))
    if verbose:
        print(f"{arch} at V={vocab_size:,}: " + ", ".join(f"{k} {v:,}" for k, v in parts.items() if v))
    return parts["total"]


def _any_size(arch: str) -> bool:
    return True


def matching_arch(
    family: str,
    given: Dict[str, Any],
    compared: Optional[Sequence[str]] = None,
    among: Callable[[str], bool] = _any_size,
) -> str:
    """The named size of ``family`` (among those ``among`` accepts) whose options equal ``given`` on ``compared``
    (default: every given option but the context length and the multi-token prediction depths, which a size
    leaves to a flag), e.g. llama3_1b for an imported Llama 3.2 1B; else the family's own name."""
    registry.import_submodules("toolkit.models")
    keys = [k for k in given if k not in ("max_target_positions", "mtp_depth")] if compared is None else list(compared)
    sizes = sorted(a for a, model in registry.ARCH_MODEL_NAME.items() if model == family and a != family and among(a))
    for arch in sizes:
        values = options.architecture_defaults(arch)
        if all(values[k] == given[k] for k in keys):
            return arch
    return family


# fairseq's names, so a plugin's ``from fairseq.models import ...`` ports by renaming the import
# (toolkit.models.fairseq_model; docs/plugins.md). Reached at first use: they need torch, the families'
# options and sizes (read by --help) do not.
__getattr__ = registry.fairseq_plugin_getattr(__name__, FAIRSEQ_NAMES)
