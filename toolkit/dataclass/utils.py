"""fairseq's ``FairseqDataclass`` and ``ChoiceEnum``: the base and the choice type of options dataclasses.

Why: fairseq plugins declare options as ``@dataclass class MyConfig(FairseqDataclass)`` with fields
typed ``ChoiceEnum([...])``; the toolkit generates flags from any dataclass (:mod:`toolkit.options`),
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
