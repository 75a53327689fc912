"""``toolkit.dataclass.utils``'s names, for plugins that import them from here; they live in
:mod:`toolkit.compat.fairseq.plugins.dataclass`."""

from toolkit.compat.fairseq.plugins.dataclass import ChoiceEnum, FairseqDataclass, StrEnum, with_enum_choices  # noqa: F401
