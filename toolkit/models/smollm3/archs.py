"""Named sizes of the SmolLM3 family: the published configuration (Hugging Face ``config.json`` values).

===================  ======  =====  =====  ===  ===  ==========  ======  =================
arch                 layers  C      F      H    G    rope theta  tied    parameters
===================  ======  =====  =====  ===  ===  ==========  ======  =================
smollm3_3b           36      2048   11008  16   4    5000000     yes     3,075,098,624
===================  ======  =====  =====  ===  ===  ==========  ======  =================

SmolLM3-3B has every fourth layer without RoPE (layers 3, 7, ..., 35); its parameter count at its own vocabulary
(``tests/unit/test_llama.py`` checks it against transformers' ``SmolLM3ForCausalLM``). ``smollm3_tiny`` is for
tests.
"""

from __future__ import annotations

from typing import Dict

from toolkit.core import registry
from toolkit.core.registry import register_model_architecture
from toolkit.models.common.options import set_shape
from toolkit.models.smollm3.config import SmolLM3Config

PUBLISHED_VOCAB_SIZE: Dict[str, int] = {"smollm3_3b": 128256}
registry.PUBLISHED_VOCAB_SIZE.update(PUBLISHED_VOCAB_SIZE)


@register_model_architecture("smollm3", "smollm3")
def smollm3(cfg: SmolLM3Config) -> None:
    """The options' own defaults (a tiny model, every fourth layer NoPE) with tied embeddings."""
    cfg.share_decoder_input_output_embed = True


@register_model_architecture("smollm3", "smollm3_3b")
def smollm3_3b(cfg: SmolLM3Config) -> None:
    """SmolLM3-3B: 16 query heads on 4 key/value heads, every fourth layer NoPE, theta 5e6, tied."""
    set_shape(cfg, layers=36, dim=2048, ffn=11008, heads=16, kv=4)
    cfg.rope_theta, cfg.rms_norm_eps, cfg.nope_layer_interval = 5000000.0, 1e-6, 4
    cfg.share_decoder_input_output_embed = True


@register_model_architecture("smollm3", "smollm3_tiny")
def smollm3_tiny(cfg: SmolLM3Config) -> None:
    """For tests: 2 x 32, a rotating layer then a NoPE one, 4 heads on 2 key/value heads, tied."""
    set_shape(cfg, layers=2, dim=32, ffn=64, heads=4, kv=2)
    cfg.rope_theta, cfg.rms_norm_eps, cfg.nope_layer_interval = 5000000.0, 1e-6, 2
    cfg.share_decoder_input_output_embed = True
