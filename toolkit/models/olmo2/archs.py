"""Named sizes of the OLMo 2 family: the published configurations (Hugging Face ``config.json`` values).

===================  ======  =====  =====  ===  ===  ==========  ======  =================
arch                 layers  C      F      H    G    rope theta  tied    parameters
===================  ======  =====  =====  ===  ===  ==========  ======  =================
olmo2_1b             16      2048   8192   16   16   500000      no      1,484,916,736
olmo2_7b             32      4096   11008  32   32   500000      no      7,298,617,344
===================  ======  =====  =====  ===  ===  ==========  ======  =================

The OLMo 2 sizes (OLMo-2-0425-1B, OLMo-2-1124-7B) normalize after attention and the MLP and over the whole
q / k projections; parameter counts at each model's own vocabulary (``tests/unit/test_llama.py`` checks them
against transformers' ``Olmo2ForCausalLM``). ``olmo2_tiny`` is for tests.
"""

from __future__ import annotations

from typing import Dict

from toolkit.core import registry
from toolkit.core.registry import register_model_architecture
from toolkit.models.common.options import set_shape
from toolkit.models.olmo2.config import Olmo2Config

PUBLISHED_VOCAB_SIZE: Dict[str, int] = {"olmo2_1b": 100352, "olmo2_7b": 100352}
registry.PUBLISHED_VOCAB_SIZE.update(PUBLISHED_VOCAB_SIZE)


def _olmo2(cfg: Olmo2Config) -> None:
    """OLMo 2: QK-norm over the whole q and k projections, theta 500000, RMSNorm eps 1e-6, untied."""
    cfg.qk_norm, cfg.qk_norm_over = True, "projection"
    cfg.rope_theta, cfg.rms_norm_eps = 500000.0, 1e-6


@register_model_architecture("olmo2", "olmo2")
def olmo2(cfg: Olmo2Config) -> None:
    """The options' own defaults (a tiny model) with OLMo 2's QK-norm over the projections; every size is a flag."""
    cfg.qk_norm = True


@register_model_architecture("olmo2", "olmo2_1b")
def olmo2_1b(cfg: Olmo2Config) -> None:
    """OLMo 2 1B (OLMo-2-0425-1B): multi-head attention."""
    set_shape(cfg, layers=16, dim=2048, ffn=8192, heads=16, kv=16)
    _olmo2(cfg)


@register_model_architecture("olmo2", "olmo2_7b")
def olmo2_7b(cfg: Olmo2Config) -> None:
    """OLMo 2 7B (OLMo-2-1124-7B): multi-head attention."""
    set_shape(cfg, layers=32, dim=4096, ffn=11008, heads=32, kv=32)
    _olmo2(cfg)


@register_model_architecture("olmo2", "olmo2_tiny")
def olmo2_tiny(cfg: Olmo2Config) -> None:
    """For tests: 2 x 64, 4 heads on 2 key/value heads, OLMo 2's norms."""
    set_shape(cfg, layers=2, dim=64, ffn=128, heads=4, kv=2)
    _olmo2(cfg)
