"""``toolkit.dataclass.utils``'s names, kept for plugins that import them from here; they live in
:mod:`toolkit.compat_plugins.dataclass`."""

from toolkit.compat_plugins.dataclass import ChoiceEnum, FairseqDataclass, StrEnum, with_enum_choices  # noqa: F401
