"""fairseq's ``fairseq.dataclass`` names (``FairseqDataclass``, ``ChoiceEnum``), for plugins that declare options
in dataclasses; they live in :mod:`toolkit.compat.fairseq.plugins.dataclass`."""

from toolkit.compat.fairseq.plugins.dataclass import ChoiceEnum, FairseqDataclass, StrEnum  # noqa: F401
