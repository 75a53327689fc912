"""fairseq's ``FairseqDataclass`` and ``ChoiceEnum``: the base and the choice type of options dataclasses.

Why: fairseq plugins declare options as ``@dataclass class MyConfig(FairseqDataclass)`` with fields
typed ``ChoiceEnum([...])``; the toolkit generates flags from any dataclass (:mod:`toolkit.config.options`),
so these two names are all a plugin needs to port by renaming the import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, EnumMeta
from typing import List, Optional


class StrEnumMeta(EnumMeta):
    # fairseq's: a choice compares and hashes as its string, so ``cfg.mode == "none"`` holds
    @classmethod
    def __instancecheck__(cls, other) -> bool:
        return "enum" in str(type(other))


class StrEnum(Enum, metaclass=StrEnumMeta):
    def __str__(self) -> str:
        return self.value

    def __eq__(self, other) -> bool:
        return self.value == other

    def __repr__(self) -> str:
        return self.value

    def __hash__(self) -> int:
        return hash(str(self))


def ChoiceEnum(choices: List[str]):  # noqa: N802 (fairseq's name)
    """An enum whose members are the given strings (a field's type; its default stays a plain string)."""
    return StrEnum("Choices", {k: k for k in choices})


@dataclass
class FairseqDataclass:
    """fairseq's base of options dataclasses. ``_name`` is the component's registered name (not a flag)."""

    _name: Optional[str] = field(default=None, metadata={"cli": False})

    @staticmethod
    def name():
        return None


def with_enum_choices(config: type) -> type:
    """``config`` with each ``ChoiceEnum``-typed field's members as its flag's choices (fairseq's parser lists
    them; the toolkit's generator reads ``metadata["choices"]``). Other dataclasses come back unchanged."""
    import typing
    from dataclasses import fields, make_dataclass

    try:
        hints = typing.get_type_hints(config)
    except NameError:  # an annotation naming something local to a function: its choices stay unchecked
        hints = {f.name: f.type for f in fields(config)}
    redone = []
    for f in fields(config):
        tp = hints.get(f.name)
        tp = next((a for a in typing.get_args(tp) if isinstance(a, type) and issubclass(a, Enum)), tp)
        if isinstance(tp, type) and issubclass(tp, Enum) and "choices" not in f.metadata:
            default = f.default.value if isinstance(f.default, Enum) else f.default
            meta = dict(f.metadata, choices=[m.value for m in tp])
            redone.append((f.name, Optional[str], field(default=default, metadata=meta)))
    if not redone:
        return config
    derived = make_dataclass(config.__name__, redone, bases=(config,))
    derived.__module__, derived.__qualname__ = config.__module__, config.__qualname__
    return derived
