"""Named sizes of the Qwen3-Next family: the published configuration (Hugging Face ``config.json`` values).

=================  ======  ====  ===  ===  ===  =====  ==  ===  ======  =======  =======  ===============
arch               layers  C     H    G    D    E      k   F    shared  Hk x Dk  Hv x Dv  total
=================  ======  ====  ===  ===  ===  =====  ==  ===  ======  =======  =======  ===============
qwen3_next_80b_a3b 48      2048  16   2    256  512    10  512  512     16 x 128 32 x 128 79,674,391,296
=================  ======  ====  ===  ===  ===  =====  ==  ===  ======  =======  =======  ===============

Qwen3.5's sizes (the text part of the released ``config.json``: ``text_config``; the linear layers' projections
split, 16 key heads of 128, values of 128, heads of 256 in the full layers, V 248320; F is the dense SwiGLU's
width, E, k and the shared expert's the MoE models'):

=================  ======  ====  ===  ===  =====  ===  ==  ====  ======  ==  ====  ===============
arch               layers  C     H    G    F      E    k   F_e   shared  Hv  tied  total
=================  ======  ====  ===  ===  =====  ===  ==  ====  ======  ==  ====  ===============
qwen3_5_0_8b       24      1024  8    2    3584   -    -   -     -       16  yes   752,393,024
qwen3_5_2b         24      2048  8    2    6144   -    -   -     -       16  yes   1,881,825,088
qwen3_5_4b         32      2560  16   4    9216   -    -   -     -       32  yes   4,205,751,296
qwen3_5_9b         32      4096  16   4    12288  -    -   -     -       32  no    8,953,803,264
qwen3_5_27b        64      5120  24   4    17408  -    -   -     -       48  no    26,895,998,464
qwen3_5_35b_a3b    40      2048  16   2    -      256  8   512   512     32  no    34,660,610,688
qwen3_5_122b_a10b  48      3072  32   2    -      256  8   1024  1024    64  no    122,111,526,912
qwen3_5_397b_a17b  60      4096  32   2    -      512  10  1024  1024    64  no    396,346,350,336
=================  ======  ====  ===  ===  =====  ===  ==  ====  ======  ==  ====  ===============

Every fourth layer is gated full attention (a quarter of each head rotated, theta 1e7), the others gated DeltaNet;
``tests/unit/test_qwen3_next.py`` checks four layers of each size against transformers' model of the same config
built on the meta device (``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``), and the
totals. The multi-token prediction layer the Qwen3.5 releases ship (``mtp_num_hidden_layers`` 1) is not part of
these models, as it is not of transformers'. ``qwen3_next_tiny``, ``qwen3_5_moe_tiny`` and ``qwen3_5_tiny`` (Qwen3.5's split projections; the last with dense
MLPs) are for tests.
"""

from __future__ import annotations

from toolkit.core import registry
from toolkit.core.registry import register_model_architecture
from toolkit.models.common.options import set_shape
from toolkit.models.qwen3_next.config import Qwen3NextConfig

QWEN3_5_SIZES = (
    "qwen3_5_0_8b",
    "qwen3_5_2b",
    "qwen3_5_4b",
    "qwen3_5_9b",
    "qwen3_5_27b",
    "qwen3_5_35b_a3b",
    "qwen3_5_122b_a10b",
    "qwen3_5_397b_a17b",
)
registry.PUBLISHED_VOCAB_SIZE.update({"qwen3_next_80b_a3b": 151936, **dict.fromkeys(QWEN3_5_SIZES, 248320)})


def _qwen3_next(cfg: Qwen3NextConfig) -> None:
    """Qwen3-Next's fixed choices: QK-norm per head, renormalized top-k, a quarter of each head rotated, eps 1e-6."""
    cfg.qk_norm, cfg.moe_renormalize, cfg.partial_rotary_factor = True, True, 0.25
    cfg.rms_norm_eps, cfg.moe_aux_loss_coef, cfg.full_attention_interval = 1e-6, 0.001, 4


@register_model_architecture("qwen3_next", "qwen3_next")
def qwen3_next(cfg: Qwen3NextConfig) -> None:
    """The options' own defaults (a tiny model) with Qwen3-Next's fixed choices and a shared expert as wide as an
    expert; every size is a flag."""
    _qwen3_next(cfg)
    cfg.moe_shared_ffn_embed_dim = cfg.moe_ffn_embed_dim


@register_model_architecture("qwen3_next", "qwen3_next_80b_a3b")
def qwen3_next_80b_a3b(cfg: Qwen3NextConfig) -> None:
    """Qwen3-Next-80B-A3B: 48 layers (12 full attention), 512 experts of width 512, 10 a token, a shared one."""
    set_shape(cfg, layers=48, dim=2048, ffn=5120, heads=16, kv=2)
    cfg.decoder_head_dim, cfg.rope_theta = 256, 10000000.0
    cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_ffn_embed_dim, cfg.moe_shared_ffn_embed_dim = 512, 10, 512, 512
    cfg.linear_num_key_heads, cfg.linear_num_value_heads = 16, 32
    cfg.linear_key_head_dim = cfg.linear_value_head_dim = 128
    _qwen3_next(cfg)


@register_model_architecture("qwen3_next", "qwen3_next_tiny")
def qwen3_next_tiny(cfg: Qwen3NextConfig) -> None:
    """For tests: 4 layers of 32 (the last full attention: 4 heads of 8 on 2), 4 experts of 16, top 2, a shared
    expert of 24, gated DeltaNet with 2 key heads of 8 and 4 value heads of 6."""
    set_shape(cfg, layers=4, dim=32, ffn=48, heads=4, kv=2)
    cfg.decoder_head_dim = 8
    cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_ffn_embed_dim, cfg.moe_shared_ffn_embed_dim = 4, 2, 16, 24
    cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim = (
        2,
        4,
        8,
        6,
    )
    _qwen3_next(cfg)
    cfg.partial_rotary_factor = 0.5


@register_model_architecture("qwen3_next", "qwen3_5_moe_tiny")
def qwen3_5_moe_tiny(cfg: Qwen3NextConfig) -> None:
    """For tests: ``qwen3_next_tiny`` as Qwen3.5's MoE models lay it out (the linear layers' projections split)."""
    qwen3_next_tiny(cfg)
    cfg.linear_split_projections = True


@register_model_architecture("qwen3_next", "qwen3_5_tiny")
def qwen3_5_tiny(cfg: Qwen3NextConfig) -> None:
    """For tests: a dense Qwen3.5 (``qwen3_5_moe_tiny`` with a SwiGLU of 48 in every layer)."""
    qwen3_5_moe_tiny(cfg)
    cfg.dense_mlp = True


def _qwen3_5(cfg: Qwen3NextConfig, value_heads: int) -> None:
    """What every Qwen3.5 size shares: Qwen3-Next's choices, heads of 256 in the full layers, theta 1e7, and
    linear layers of 16 key heads of 128 and ``value_heads`` values of 128 with their projections split."""
    cfg.decoder_head_dim, cfg.rope_theta = 256, 10000000.0
    cfg.linear_num_key_heads, cfg.linear_num_value_heads = 16, value_heads
    cfg.linear_key_head_dim = cfg.linear_value_head_dim = 128
    cfg.linear_split_projections = True
    _qwen3_next(cfg)


def _qwen3_5_dense(
    cfg: Qwen3NextConfig, layers: int, dim: int, ffn: int, heads: int, kv: int, value_heads: int
) -> None:
    """A dense Qwen3.5 (``Qwen3_5ForCausalLM``): a SwiGLU of ``ffn`` in every layer."""
    set_shape(cfg, layers=layers, dim=dim, ffn=ffn, heads=heads, kv=kv)
    _qwen3_5(cfg, value_heads)
    cfg.dense_mlp = True


def _qwen3_5_moe(cfg: Qwen3NextConfig, layers: int, dim: int, heads: int, experts: int, top_k: int, width: int) -> None:
    """A Qwen3.5 MoE (``Qwen3_5MoeForCausalLM``): ``experts`` of ``width``, ``top_k`` a token, a gated shared
    expert as wide, 2 key/value heads in the full layers; every layer's MLP is the experts (F is unused)."""
    set_shape(cfg, layers=layers, dim=dim, ffn=width, heads=heads, kv=2)
    cfg.moe_num_experts, cfg.moe_top_k = experts, top_k
    cfg.moe_ffn_embed_dim = cfg.moe_shared_ffn_embed_dim = width


@register_model_architecture("qwen3_next", "qwen3_5_0_8b")
def qwen3_5_0_8b(cfg: Qwen3NextConfig) -> None:
    """Qwen3.5-0.8B: 24 layers of 1024, a SwiGLU of 3584, 16 value heads, tied embeddings."""
    _qwen3_5_dense(cfg, layers=24, dim=1024, ffn=3584, heads=8, kv=2, value_heads=16)
    cfg.share_decoder_input_output_embed = True


@register_model_architecture("qwen3_next", "qwen3_5_2b")
def qwen3_5_2b(cfg: Qwen3NextConfig) -> None:
    """Qwen3.5-2B: 24 layers of 2048, a SwiGLU of 6144, 16 value heads, tied embeddings."""
    _qwen3_5_dense(cfg, layers=24, dim=2048, ffn=6144, heads=8, kv=2, value_heads=16)
    cfg.share_decoder_input_output_embed = True


@register_model_architecture("qwen3_next", "qwen3_5_4b")
def qwen3_5_4b(cfg: Qwen3NextConfig) -> None:
    """Qwen3.5-4B: 32 layers of 2560, a SwiGLU of 9216, 16 query heads on 4, 32 value heads, tied embeddings."""
    _qwen3_5_dense(cfg, layers=32, dim=2560, ffn=9216, heads=16, kv=4, value_heads=32)
    cfg.share_decoder_input_output_embed = True


@register_model_architecture("qwen3_next", "qwen3_5_9b")
def qwen3_5_9b(cfg: Qwen3NextConfig) -> None:
    """Qwen3.5-9B: 32 layers of 4096, a SwiGLU of 12288, 32 value heads."""
    _qwen3_5_dense(cfg, layers=32, dim=4096, ffn=12288, heads=16, kv=4, value_heads=32)


@register_model_architecture("qwen3_next", "qwen3_5_27b")
def qwen3_5_27b(cfg: Qwen3NextConfig) -> None:
    """Qwen3.5-27B: 64 layers of 5120, a SwiGLU of 17408, 24 query heads on 4, 48 value heads."""
    _qwen3_5_dense(cfg, layers=64, dim=5120, ffn=17408, heads=24, kv=4, value_heads=48)


@register_model_architecture("qwen3_next", "qwen3_5_35b_a3b")
def qwen3_5_35b_a3b(cfg: Qwen3NextConfig) -> None:
    """Qwen3.5-35B-A3B: 40 layers of 2048, 256 experts of 512 (8 a token), 32 value heads."""
    _qwen3_5_moe(cfg, layers=40, dim=2048, heads=16, experts=256, top_k=8, width=512)
    _qwen3_5(cfg, value_heads=32)


@register_model_architecture("qwen3_next", "qwen3_5_122b_a10b")
def qwen3_5_122b_a10b(cfg: Qwen3NextConfig) -> None:
    """Qwen3.5-122B-A10B: 48 layers of 3072, 256 experts of 1024 (8 a token), 64 value heads."""
    _qwen3_5_moe(cfg, layers=48, dim=3072, heads=32, experts=256, top_k=8, width=1024)
    _qwen3_5(cfg, value_heads=64)


@register_model_architecture("qwen3_next", "qwen3_5_397b_a17b")
def qwen3_5_397b_a17b(cfg: Qwen3NextConfig) -> None:
    """Qwen3.5-397B-A17B: 60 layers of 4096, 512 experts of 1024 (10 a token), 64 value heads."""
    _qwen3_5_moe(cfg, layers=60, dim=4096, heads=32, experts=512, top_k=10, width=1024)
    _qwen3_5(cfg, value_heads=64)
