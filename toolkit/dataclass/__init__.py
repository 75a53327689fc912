"""fairseq's ``fairseq.dataclass`` names (``FairseqDataclass``, ``ChoiceEnum``), for plugins that declare options
in dataclasses; they live in :mod:`toolkit.compat_plugins.dataclass`."""

from toolkit.compat_plugins.dataclass import ChoiceEnum, FairseqDataclass, StrEnum  # noqa: F401
