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
llama2_7b            32      4096   11008  32   32   10000       -        no      6,738,415,616
tinyllama_1_1b       22      2048   5632   32   4    10000       -        no      1,100,048,384
qwen2_0_5b           24      896    4864   14   2    1000000     -        yes     494,032,768
mistral_7b           32      4096   14336  32   8    10000       -        no      7,241,732,096
qwen3_0_6b           28      1024   3072   16   8    1000000     -        yes     596,049,920
qwen3_1_7b           28      2048   6144   16   8    1000000     -        yes     1,720,574,976
qwen3_8b             36      4096   12288  32   8    1000000     -        no      8,190,735,360
olmo2_1b             16      2048   8192   16   16   500000      -        no      1,484,916,736
olmo2_7b             32      4096   11008  32   32   500000      -        no      7,298,617,344
gemma3_1b            26      1152   6912   4    1    1e6 / 1e4   -        yes     999,885,952
gemma3_4b            34      2560   10240  8    4    1e6 / 1e4   -        yes     3,880,263,168
===================  ======  =====  =====  ===  ===  ==========  =======  ======  =================

``llama3_1b`` / ``llama3_3b`` are Llama 3.2 1B / 3B, ``llama3_8b`` is Llama 3.1 8B (Llama 3 8B has
the same shapes without the RoPE scaling), ``mistral_7b`` is Mistral 7B v0.1 without its sliding
window (full causal attention, as v0.2 and later). The Qwen3 sizes have QK-norm and heads of 128 whatever
the width (H x 128 is not C). The OLMo 2 sizes (OLMo-2-0425-1B, OLMo-2-1124-7B) normalize after attention
and the MLP and over the whole q / k projections. The Gemma 3 sizes (``gemma3_4b``: its language
model) have heads of 256 and every 6th layer global (rotary bases global / local). ``llama_tiny`` /
``llama_tiny_gqa`` / ``qwen3_tiny`` / ``olmo2_tiny`` / ``gemma3_tiny`` are for tests.
"""

from __future__ import annotations

from typing import Dict

from toolkit.models.llama.config import LlamaConfig
from toolkit.core import registry
from toolkit.core.registry import register_model_architecture

PUBLISHED_VOCAB_SIZE: Dict[str, int] = {
    "llama3_1b": 128256,
    "llama3_3b": 128256,
    "llama3_8b": 128256,
    "llama2_7b": 32000,
    "tinyllama_1_1b": 32000,
    "qwen2_0_5b": 151936,
    "mistral_7b": 32000,
    "qwen3_0_6b": 151936,
    "qwen3_1_7b": 151936,
    "qwen3_8b": 151936,
    "olmo2_1b": 100352,
    "olmo2_7b": 100352,
    "gemma3_1b": 262144,
    "gemma3_4b": 262208,
}
registry.PUBLISHED_VOCAB_SIZE.update(PUBLISHED_VOCAB_SIZE)


def _shape(cfg: LlamaConfig, layers: int, dim: int, ffn: int, heads: int, kv: int) -> None:
    cfg.decoder_layers, cfg.decoder_embed_dim, cfg.decoder_ffn_embed_dim = layers, dim, ffn
    cfg.decoder_attention_heads, cfg.decoder_kv_heads = heads, kv


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
    _shape(cfg, layers=2, dim=64, ffn=128, heads=4, kv=2)


@register_model_architecture("llama", "llama_tiny_gqa")
def llama_tiny_gqa(cfg: LlamaConfig) -> None:
    """For tests: 2 x 64, 8 query heads on 2 key/value heads (head size 8), tied, Llama 3's RoPE scaling."""
    _shape(cfg, layers=2, dim=64, ffn=160, heads=8, kv=2)
    _llama3_rope(cfg, factor=8.0)
    cfg.rope_original_max_positions = 64
    cfg.share_decoder_input_output_embed = True


def _llama3_2(cfg: LlamaConfig, layers: int, dim: int, heads: int) -> None:
    """Llama 3.2's small models: FFN 8192, 8 key/value heads, RoPE scaling 32, tied embeddings."""
    _shape(cfg, layers=layers, dim=dim, ffn=8192, heads=heads, kv=8)
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
    _shape(cfg, layers=32, dim=4096, ffn=14336, heads=32, kv=8)
    _llama3_rope(cfg, factor=8.0)


@register_model_architecture("llama", "llama2_7b")
def llama2_7b(cfg: LlamaConfig) -> None:
    """Llama 2 7B: multi-head attention (32 key/value heads)."""
    _shape(cfg, layers=32, dim=4096, ffn=11008, heads=32, kv=32)


@register_model_architecture("llama", "tinyllama_1_1b")
def tinyllama_1_1b(cfg: LlamaConfig) -> None:
    """TinyLlama 1.1B."""
    _shape(cfg, layers=22, dim=2048, ffn=5632, heads=32, kv=4)


@register_model_architecture("llama", "qwen2_0_5b")
def qwen2_0_5b(cfg: LlamaConfig) -> None:
    """Qwen2 0.5B: q/k/v biases, tied embeddings."""
    _shape(cfg, layers=24, dim=896, ffn=4864, heads=14, kv=2)
    cfg.rope_theta, cfg.rms_norm_eps = 1000000.0, 1e-6
    cfg.attention_qkv_bias = True
    cfg.share_decoder_input_output_embed = True


@register_model_architecture("llama", "mistral_7b")
def mistral_7b(cfg: LlamaConfig) -> None:
    """Mistral 7B (v0.1 shapes; full causal attention, no sliding window)."""
    _shape(cfg, layers=32, dim=4096, ffn=14336, heads=32, kv=8)


def _qwen3(cfg: LlamaConfig, layers: int, dim: int, ffn: int, heads: int, tied: bool) -> None:
    """Qwen3's dense models: 8 key/value heads of size 128, QK-norm, theta 1e6, RMSNorm eps 1e-6."""
    _shape(cfg, layers=layers, dim=dim, ffn=ffn, heads=heads, kv=8)
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
    _shape(cfg, layers=2, dim=64, ffn=128, heads=4, kv=2)
    cfg.decoder_head_dim, cfg.qk_norm = 32, True
    cfg.rope_theta, cfg.rms_norm_eps = 1000000.0, 1e-6
    cfg.share_decoder_input_output_embed = True


def _olmo2(cfg: LlamaConfig, layers: int, dim: int, ffn: int, heads: int) -> None:
    """OLMo 2: RMSNorm after attention and after the MLP, QK-norm over the whole q and k projections,
    multi-head attention, theta 500000, RMSNorm eps 1e-6, untied."""
    _shape(cfg, layers=layers, dim=dim, ffn=ffn, heads=heads, kv=heads)
    cfg.qk_norm, cfg.qk_norm_over, cfg.norm_after_sublayer = True, "projection", True
    cfg.rope_theta, cfg.rms_norm_eps = 500000.0, 1e-6


@register_model_architecture("llama", "olmo2_1b")
def olmo2_1b(cfg: LlamaConfig) -> None:
    """OLMo 2 1B (OLMo-2-0425-1B)."""
    _olmo2(cfg, layers=16, dim=2048, ffn=8192, heads=16)


@register_model_architecture("llama", "olmo2_7b")
def olmo2_7b(cfg: LlamaConfig) -> None:
    """OLMo 2 7B (OLMo-2-1124-7B)."""
    _olmo2(cfg, layers=32, dim=4096, ffn=11008, heads=32)


@register_model_architecture("llama", "olmo2_tiny")
def olmo2_tiny(cfg: LlamaConfig) -> None:
    """For tests: 2 x 64, 4 heads on 2 key/value heads, OLMo 2's norms."""
    _shape(cfg, layers=2, dim=64, ffn=128, heads=4, kv=2)
    cfg.qk_norm, cfg.qk_norm_over, cfg.norm_after_sublayer = True, "projection", True
    cfg.rope_theta, cfg.rms_norm_eps = 500000.0, 1e-6


def _gemma3(cfg: LlamaConfig, layers: int, dim: int, ffn: int, heads: int, kv: int, window: int) -> None:
    """Gemma 3 text: every 6th layer global, the others local within ``window``; heads of 256, (1 + w)
    norms around both sublayers, GeGLU, scores scaled by 1/sqrt(256), rotary bases 1e6 (global) and 1e4
    (local), tied embeddings times sqrt(width)."""
    _shape(cfg, layers=layers, dim=dim, ffn=ffn, heads=heads, kv=kv)
    cfg.decoder_head_dim, cfg.qk_norm, cfg.gemma_norms, cfg.mlp_activation = 256, True, True, "gelu_tanh"
    cfg.query_pre_attn_scalar, cfg.rope_theta, cfg.rope_local_theta, cfg.rms_norm_eps = 256.0, 1e6, 1e4, 1e-6
    cfg.sliding_window = window
    cfg.layer_types = ",".join("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers))
    cfg.share_decoder_input_output_embed = True


@register_model_architecture("llama", "gemma3_1b")
def gemma3_1b(cfg: LlamaConfig) -> None:
    """Gemma 3 1B."""
    _gemma3(cfg, layers=26, dim=1152, ffn=6912, heads=4, kv=1, window=512)


@register_model_architecture("llama", "gemma3_4b")
def gemma3_4b(cfg: LlamaConfig) -> None:
    """Gemma 3 4B's language model (the published global layers also scale RoPE linearly by 8 for 128k)."""
    _gemma3(cfg, layers=34, dim=2560, ffn=10240, heads=8, kv=4, window=1024)


@register_model_architecture("llama", "gemma3_tiny")
def gemma3_tiny(cfg: LlamaConfig) -> None:
    """For tests: 2 x 64, a local layer (window 6) then a global one, heads of 32."""
    _shape(cfg, layers=2, dim=64, ffn=128, heads=4, kv=2)
    cfg.decoder_head_dim, cfg.qk_norm, cfg.gemma_norms, cfg.mlp_activation = 32, True, True, "gelu_tanh"
    cfg.query_pre_attn_scalar, cfg.rope_theta, cfg.rope_local_theta, cfg.rms_norm_eps = 32.0, 1e6, 1e4, 1e-6
    cfg.sliding_window, cfg.layer_types = 6, "sliding_attention,full_attention"
    cfg.share_decoder_input_output_embed = True
