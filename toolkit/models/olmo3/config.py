"""Options of the OLMo 3 family (``--arch olmo3`` and its named sizes): OLMo 2's (``toolkit.models.olmo2.config``),
``--sliding-window`` and ``--layer-types`` saying which layers are local. With ``--rope-scaling-factor`` the global
layers rotate scaled and the local ones unscaled, at the same ``--rope-theta``: what makes the family, not an option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict

from toolkit.models.common.options import absent_options
from toolkit.models.olmo2.config import Olmo2Config


@dataclass
class Olmo3Config(Olmo2Config):
    ABSENT_OPTIONS: ClassVar[Dict[str, str]] = absent_options(
        "the OLMo 3 family", "OLMo 3 blocks always normalize the outputs of attention and the MLP (RMSNorm)"
    )
