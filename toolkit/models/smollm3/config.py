"""Options of the SmolLM3 family (``--arch smollm3`` and its named sizes): the Llama family's
(``toolkit.models.llama.config``) and which layers attend without rotary embeddings (NoPE; Hugging Face's key in
brackets):

``--nope-layer-interval``       every N-th layer (the N-th, 2N-th, ...) has no RoPE (``no_rope_layer_interval``);
                                0: every layer rotates
``--nope-layers``               the layers without RoPE by index from 0, comma-separated, in place of the interval
                                (``no_rope_layers``, whose 0 entries they are)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Dict, List, Optional

from toolkit.config.flag_types import non_negative_int
from toolkit.core.errors import UserError
from toolkit.models.common.options import absent_options
from toolkit.models.llama.config import LlamaConfig


@dataclass
class SmolLM3Config(LlamaConfig):
    ABSENT_OPTIONS: ClassVar[Dict[str, str]] = {
        **LlamaConfig.ABSENT_OPTIONS,
        **absent_options(
            "the SmolLM3 family", "SmolLM3 blocks always normalize before attention and the MLP (RMSNorm)"
        ),
    }

    nope_layer_interval: int = field(
        default=4,
        metadata={
            "type": non_negative_int,
            "help": "every N-th layer attends without rotary embeddings (NoPE; SmolLM3's 4); 0: every layer rotates",
        },
    )
    nope_layers: Optional[str] = field(
        default=None,
        metadata={
            "help": "the layers without rotary embeddings by index from 0, comma-separated (default: every "
            "--nope-layer-interval-th)"
        },
    )


def nope_layers(cfg: SmolLM3Config) -> List[int]:
    """The indices of the layers that attend without rotary embeddings; one line naming the flag when one is wrong."""
    L = cfg.decoder_layers
    if cfg.nope_layers is None:
        interval = cfg.nope_layer_interval
        return [i for i in range(L) if interval and (i + 1) % interval == 0]
    try:
        layers = sorted({int(i) for i in cfg.nope_layers.split(",") if i.strip()})
    except ValueError:
        layers = [-1]
    if any(not 0 <= i < L for i in layers):
        raise UserError(
            f"--nope-layers {cfg.nope_layers}: give layer indices from 0 to {L - 1} (--decoder-layers {L}), "
            "comma-separated"
        )
    return layers
