"""fairseq's ``fairseq.dataclass`` names (``FairseqDataclass``, ``ChoiceEnum``), for plugins that declare options
in dataclasses; see toolkit.dataclass.utils."""
from toolkit.dataclass.utils import ChoiceEnum, FairseqDataclass, StrEnum  # noqa: F401
