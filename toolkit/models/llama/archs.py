"""Named sizes of the Llama family: the published configurations (Hugging Face ``config.json`` values).

Parameter counts at each model's own vocabulary (``PUBLISHED_VOCAB_SIZE``, what
``python -m toolkit.models.accounting ARCH`` uses when ``--vocab-size`` is not given) equal the
published ones; ``tests/{unit,integration}/test_llama.py`` checks them. Under ``toolkit-train`` the vocabulary is the
data-bin's dictionary, so the count follows it.

===================  ======  =====  =====  ===  ===  ==========  =======  ======  =================
arch                 layers  C      F      H    G    rope theta  scaling  tied    parameters
===================  ======  =====  =====  ===  ===  ==========  =======  ======  =================
llama3_1b            16      2048   8192   32   8    500000      32       yes     1,235,814,400
llama3_3b            28      3072   8192   24   8    500000      32       yes     3,212,749,824
llama3_8b            32      4096   14336  32   8    500000      8        no      8,030,261,248
llama3_70b           80      8192   28672  64   8    500000      8        no      70,553,706,496
llama3_405b          126     16384  53248  128  8    500000      8        no      405,853,388,800
llama2_7b            32      4096   11008  32   32   10000       -        no      6,738,415,616
tinyllama_1_1b       22      2048   5632   32   4    10000       -        no      1,100,048,384
qwen2_0_5b           24      896    4864   14   2    1000000     -        yes     494,032,768
mistral_7b           32      4096   14336  32   8    10000       -        no      7,241,732,096
qwen3_0_6b           28      1024   3072   16   8    1000000     -        yes     596,049,920
qwen3_1_7b           28      2048   6144   16   8    1000000     -        yes     1,720,574,976
qwen3_8b             36      4096   12288  32   8    1000000     -        no      8,190,735,360
===================  ======  =====  =====  ===  ===  ==========  =======  ======  =================

``llama3_1b`` / ``llama3_3b`` are Llama 3.2 1B / 3B, ``llama3_8b`` / ``llama3_70b`` / ``llama3_405b`` are Llama
3.1 8B / 70B / 405B (Llama 3 8B and 70B have the same shapes without the RoPE scaling; the two large ones are what
``--pipeline-parallel-size`` is for), ``mistral_7b`` is Mistral 7B v0.1 without its sliding
window (full causal attention, as v0.2 and later). The Qwen3 sizes have QK-norm and heads of 128 whatever
the width (H x 128 is not C). ``llama_tiny`` / ``llama_tiny_gqa`` / ``qwen3_tiny`` are for tests. OLMo 2's
sizes are ``olmo2/archs.py``'s, Gemma 3's ``gemma3/archs.py``'s.
"""

from __future__ import annotations

from typing import Dict

from toolkit.core import registry
from toolkit.core.registry import register_model_architecture
from toolkit.models.common.options import set_shape
from toolkit.models.llama.config import LlamaConfig

PUBLISHED_VOCAB_SIZE: Dict[str, int] = {
    "llama3_1b": 128256,
    "llama3_3b": 128256,
    "llama3_8b": 128256,
    "llama3_70b": 128256,
    "llama3_405b": 128256,
    "llama2_7b": 32000,
    "tinyllama_1_1b": 32000,
    "qwen2_0_5b": 151936,
    "mistral_7b": 32000,
    "qwen3_0_6b": 151936,
    "qwen3_1_7b": 151936,
    "qwen3_8b": 151936,
}
registry.PUBLISHED_VOCAB_SIZE.update(PUBLISHED_VOCAB_SIZE)


def _llama3_rope(cfg: LlamaConfig, factor: float) -> None:
    """Llama 3.1 / 3.2: theta 500000 with the ``llama3`` frequency scaling (original context 8192)."""
    cfg.rope_theta = 500000.0
    cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor = factor, 1.0, 4.0
    cfg.rope_original_max_positions = 8192


@register_model_architecture("llama", "llama")
def llama(cfg: LlamaConfig) -> None:
    """The options' own defaults (a tiny model); every size is a flag."""


@register_model_architecture("llama", "llama_tiny")
def llama_tiny(cfg: LlamaConfig) -> None:
    """For tests: 2 x 64, 4 query heads on 2 key/value heads, untied."""
    set_shape(cfg, layers=2, dim=64, ffn=128, heads=4, kv=2)


@register_model_architecture("llama", "llama_tiny_gqa")
def llama_tiny_gqa(cfg: LlamaConfig) -> None:
    """For tests: 2 x 64, 8 query heads on 2 key/value heads (head size 8), tied, Llama 3's RoPE scaling."""
    set_shape(cfg, layers=2, dim=64, ffn=160, heads=8, kv=2)
    _llama3_rope(cfg, factor=8.0)
    cfg.rope_original_max_positions = 64
    cfg.share_decoder_input_output_embed = True


def _llama3_2(cfg: LlamaConfig, layers: int, dim: int, heads: int) -> None:
    """Llama 3.2's small models: FFN 8192, 8 key/value heads, RoPE scaling 32, tied embeddings."""
    set_shape(cfg, layers=layers, dim=dim, ffn=8192, heads=heads, kv=8)
    _llama3_rope(cfg, factor=32.0)
    cfg.share_decoder_input_output_embed = True


@register_model_architecture("llama", "llama3_1b")
def llama3_1b(cfg: LlamaConfig) -> None:
    """Llama 3.2 1B."""
    _llama3_2(cfg, layers=16, dim=2048, heads=32)


@register_model_architecture("llama", "llama3_3b")
def llama3_3b(cfg: LlamaConfig) -> None:
    """Llama 3.2 3B."""
    _llama3_2(cfg, layers=28, dim=3072, heads=24)


@register_model_architecture("llama", "llama3_8b")
def llama3_8b(cfg: LlamaConfig) -> None:
    """Llama 3.1 8B."""
    set_shape(cfg, layers=32, dim=4096, ffn=14336, heads=32, kv=8)
    _llama3_rope(cfg, factor=8.0)


@register_model_architecture("llama", "llama3_70b")
def llama3_70b(cfg: LlamaConfig) -> None:
    """Llama 3.1 70B."""
    set_shape(cfg, layers=80, dim=8192, ffn=28672, heads=64, kv=8)
    _llama3_rope(cfg, factor=8.0)


@register_model_architecture("llama", "llama3_405b")
def llama3_405b(cfg: LlamaConfig) -> None:
    """Llama 3.1 405B."""
    set_shape(cfg, layers=126, dim=16384, ffn=53248, heads=128, kv=8)
    _llama3_rope(cfg, factor=8.0)


@register_model_architecture("llama", "llama2_7b")
def llama2_7b(cfg: LlamaConfig) -> None:
    """Llama 2 7B: multi-head attention (32 key/value heads)."""
    set_shape(cfg, layers=32, dim=4096, ffn=11008, heads=32, kv=32)


@register_model_architecture("llama", "tinyllama_1_1b")
def tinyllama_1_1b(cfg: LlamaConfig) -> None:
    """TinyLlama 1.1B."""
    set_shape(cfg, layers=22, dim=2048, ffn=5632, heads=32, kv=4)


@register_model_architecture("llama", "qwen2_0_5b")
def qwen2_0_5b(cfg: LlamaConfig) -> None:
    """Qwen2 0.5B: q/k/v biases, tied embeddings."""
    set_shape(cfg, layers=24, dim=896, ffn=4864, heads=14, kv=2)
    cfg.rope_theta, cfg.rms_norm_eps = 1000000.0, 1e-6
    cfg.attention_qkv_bias = True
    cfg.share_decoder_input_output_embed = True


@register_model_architecture("llama", "mistral_7b")
def mistral_7b(cfg: LlamaConfig) -> None:
    """Mistral 7B (v0.1 shapes; full causal attention, no sliding window)."""
    set_shape(cfg, layers=32, dim=4096, ffn=14336, heads=32, kv=8)


def _qwen3(cfg: LlamaConfig, layers: int, dim: int, ffn: int, heads: int, tied: bool) -> None:
    """Qwen3's dense models: 8 key/value heads of size 128, QK-norm, theta 1e6, RMSNorm eps 1e-6."""
    set_shape(cfg, layers=layers, dim=dim, ffn=ffn, heads=heads, kv=8)
    cfg.decoder_head_dim, cfg.qk_norm = 128, True
    cfg.rope_theta, cfg.rms_norm_eps = 1000000.0, 1e-6
    cfg.share_decoder_input_output_embed = tied


@register_model_architecture("llama", "qwen3_0_6b")
def qwen3_0_6b(cfg: LlamaConfig) -> None:
    """Qwen3 0.6B."""
    _qwen3(cfg, layers=28, dim=1024, ffn=3072, heads=16, tied=True)


@register_model_architecture("llama", "qwen3_1_7b")
def qwen3_1_7b(cfg: LlamaConfig) -> None:
    """Qwen3 1.7B."""
    _qwen3(cfg, layers=28, dim=2048, ffn=6144, heads=16, tied=True)


@register_model_architecture("llama", "qwen3_8b")
def qwen3_8b(cfg: LlamaConfig) -> None:
    """Qwen3 8B."""
    _qwen3(cfg, layers=36, dim=4096, ffn=12288, heads=32, tied=False)


@register_model_architecture("llama", "qwen3_tiny")
def qwen3_tiny(cfg: LlamaConfig) -> None:
    """For tests: 2 x 64, 4 query heads of size 32 (not 64 / 4) on 2 key/value heads, QK-norm, tied."""
    set_shape(cfg, layers=2, dim=64, ffn=128, heads=4, kv=2)
    cfg.decoder_head_dim, cfg.qk_norm = 32, True
    cfg.rope_theta, cfg.rms_norm_eps = 1000000.0, 1e-6
    cfg.share_decoder_input_output_embed = True
