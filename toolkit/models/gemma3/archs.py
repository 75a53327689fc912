"""Named sizes of the Gemma family: the published configurations (Hugging Face ``config.json`` values).

===================  ======  =====  =====  ===  ===  ==========  ======  =================
arch                 layers  C      F      H    G    rope theta  tied    parameters
===================  ======  =====  =====  ===  ===  ==========  ======  =================
gemma3_1b            26      1152   6912   4    1    1e6 / 1e4   yes     999,885,952
gemma3_4b            34      2560   10240  8    4    1e6 / 1e4   yes     3,880,263,168
===================  ======  =====  =====  ===  ===  ==========  ======  =================

The Gemma 3 sizes (``gemma3_4b``: its language model) have heads of 256 and every 6th layer global (rotary
bases global / local); parameter counts at each model's own vocabulary (``tests/unit/test_llama.py`` checks
them against transformers' ``Gemma3ForCausalLM``). ``gemma3_tiny`` is for tests.
"""

from __future__ import annotations

from typing import Dict

from toolkit.core import registry
from toolkit.core.registry import register_model_architecture
from toolkit.models.common.options import set_shape
from toolkit.models.gemma3.config import Gemma3Config

PUBLISHED_VOCAB_SIZE: Dict[str, int] = {"gemma3_1b": 262144, "gemma3_4b": 262208}
registry.PUBLISHED_VOCAB_SIZE.update(PUBLISHED_VOCAB_SIZE)


def _gemma(cfg: Gemma3Config) -> None:
    """What every Gemma 3 text model has: QK-norm, GeGLU, tied embeddings."""
    cfg.qk_norm, cfg.mlp_activation = True, "gelu_tanh"
    cfg.share_decoder_input_output_embed = True


@register_model_architecture("gemma3", "gemma3")
def gemma3(cfg: Gemma3Config) -> None:
    """The options' own defaults (a tiny model) with Gemma's QK-norm, GeGLU and tied embeddings; every size is a
    flag."""
    _gemma(cfg)


def _gemma3(cfg: Gemma3Config, layers: int, dim: int, ffn: int, heads: int, kv: int, window: int) -> None:
    """Gemma 3 text: every 6th layer global, the others local within ``window``; heads of 256, scores scaled by
    1/sqrt(256), rotary bases 1e6 (global) and 1e4 (local)."""
    set_shape(cfg, layers=layers, dim=dim, ffn=ffn, heads=heads, kv=kv)
    _gemma(cfg)
    cfg.decoder_head_dim = 256
    cfg.query_pre_attn_scalar, cfg.rope_theta, cfg.rope_local_theta, cfg.rms_norm_eps = 256.0, 1e6, 1e4, 1e-6
    cfg.sliding_window = window
    cfg.layer_types = ",".join("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers))


@register_model_architecture("gemma3", "gemma3_1b")
def gemma3_1b(cfg: Gemma3Config) -> None:
    """Gemma 3 1B."""
    _gemma3(cfg, layers=26, dim=1152, ffn=6912, heads=4, kv=1, window=512)


@register_model_architecture("gemma3", "gemma3_4b")
def gemma3_4b(cfg: Gemma3Config) -> None:
    """Gemma 3 4B's language model (the published global layers also scale RoPE linearly by 8 for 128k)."""
    _gemma3(cfg, layers=34, dim=2560, ffn=10240, heads=8, kv=4, window=1024)


@register_model_architecture("gemma3", "gemma3_tiny")
def gemma3_tiny(cfg: Gemma3Config) -> None:
    """For tests: 2 x 64, a local layer (window 6) then a global one, heads of 32."""
    set_shape(cfg, layers=2, dim=64, ffn=128, heads=4, kv=2)
    _gemma(cfg)
    cfg.decoder_head_dim = 32
    cfg.query_pre_attn_scalar, cfg.rope_theta, cfg.rope_local_theta, cfg.rms_norm_eps = 32.0, 1e6, 1e4, 1e-6
    cfg.sliding_window, cfg.layer_types = 6, "sliding_attention,full_attention"
