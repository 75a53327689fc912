"""Named sizes of the OLMo 3 family: the published configurations (Hugging Face ``config.json`` values).

===================  ======  =====  =====  ===  ===  ==========  ======  =================
arch                 layers  C      F      H    G    rope theta  tied    parameters
===================  ======  =====  =====  ===  ===  ==========  ======  =================
olmo3_7b             32      4096   11008  32   32   500000      no      7,298,011,136
olmo3_32b            64      5120   27648  40   8    500000      no      32,233,522,176
===================  ======  =====  =====  ===  ===  ==========  ======  =================

The OLMo 3 sizes (Olmo-3-1025-7B, Olmo-3-1125-32B) are OLMo 2's blocks with three of every four layers local
(window 4096, every fourth layer global) and YaRN (factor 8 over 8192 positions) on the global layers only;
parameter counts at their own vocabulary (``tests/unit/test_llama.py`` checks them against transformers'
``Olmo3ForCausalLM``). ``olmo3_tiny`` is for tests.
"""

from __future__ import annotations

from typing import Dict

from toolkit.core import registry
from toolkit.core.registry import register_model_architecture
from toolkit.models.common.options import set_shape
from toolkit.models.olmo3.config import Olmo3Config

PUBLISHED_VOCAB_SIZE: Dict[str, int] = {"olmo3_7b": 100278, "olmo3_32b": 100278}
registry.PUBLISHED_VOCAB_SIZE.update(PUBLISHED_VOCAB_SIZE)


def three_local_one_global(layers: int) -> str:
    """``--layer-types`` of OLMo 3: every fourth layer global, the others local (``Olmo3Config``'s default)."""
    return ",".join("full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers))


def _olmo3(cfg: Olmo3Config, window: int) -> None:
    """OLMo 3: OLMo 2's QK-norm, theta 500000, RMSNorm eps 1e-6, untied; three of four layers local."""
    cfg.qk_norm, cfg.qk_norm_over = True, "projection"
    cfg.rope_theta, cfg.rms_norm_eps = 500000.0, 1e-6
    cfg.sliding_window, cfg.layer_types = window, three_local_one_global(cfg.decoder_layers)


def _published(cfg: Olmo3Config) -> None:
    """The released models: window 4096, YaRN by 8 over 8192 positions on the global layers (65536 positions)."""
    _olmo3(cfg, window=4096)
    cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_original_max_positions = "yarn", 8.0, 8192


@register_model_architecture("olmo3", "olmo3")
def olmo3(cfg: Olmo3Config) -> None:
    """The options' own defaults (a tiny model) with OLMo 2's QK-norm over the projections; windows are flags."""
    cfg.qk_norm = True


@register_model_architecture("olmo3", "olmo3_7b")
def olmo3_7b(cfg: Olmo3Config) -> None:
    """OLMo 3 7B (Olmo-3-1025-7B): multi-head attention."""
    set_shape(cfg, layers=32, dim=4096, ffn=11008, heads=32, kv=32)
    _published(cfg)


@register_model_architecture("olmo3", "olmo3_32b")
def olmo3_32b(cfg: Olmo3Config) -> None:
    """OLMo 3 32B (Olmo-3-1125-32B): 40 query heads on 8 key/value heads."""
    set_shape(cfg, layers=64, dim=5120, ffn=27648, heads=40, kv=8)
    _published(cfg)


@register_model_architecture("olmo3", "olmo3_tiny")
def olmo3_tiny(cfg: Olmo3Config) -> None:
    """For tests: 2 x 32, a local layer (window 4) then a global one, 4 heads on 2 key/value heads, YaRN on the
    global layer."""
    set_shape(cfg, layers=2, dim=32, ffn=64, heads=4, kv=2)
    _olmo3(cfg, window=4)
    cfg.layer_types = "sliding_attention,full_attention"
    cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_original_max_positions = "yarn", 4.0, 8
