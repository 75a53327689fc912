"""Named architectures of the ``transformer_lm`` family (``--arch``): fairseq's GPT-1/2/3, Baevski & Auli's
adaptive-input models and the Megatron sizes. Each sets values on a fresh config; the user's flags override them."""

from __future__ import annotations

from toolkit.models.transformer_lm.config import TransformerLMConfig
from toolkit.core.registry import register_model_architecture


@register_model_architecture("transformer_lm", "transformer_lm")
def transformer_lm(cfg: TransformerLMConfig) -> None:
    """fairseq's config defaults as they are: since fairseq 0.11 the model's own name is a no-op architecture
    (base_lm_architecture runs only for the named ones). So ``--arch transformer_lm`` is post-norm without a
    final LayerNorm, with 512-wide input and output embeddings whatever --decoder-embed-dim is
    (project_in_dim / project_out_dim map them when it differs). fairseq 0.10 ran base_lm_architecture here."""
    cfg.decoder_normalize_before = False
    cfg.decoder_input_dim = cfg.decoder_output_dim = 512


def base_lm_architecture(cfg: TransformerLMConfig) -> None:
    # fairseq's base_lm_architecture, called by every named transformer_lm arch, forces pre-norm.
    cfg.decoder_normalize_before = True


@register_model_architecture("transformer_lm", "transformer_lm_big")
def transformer_lm_big(cfg: TransformerLMConfig) -> None:
    base_lm_architecture(cfg)
    cfg.decoder_layers, cfg.decoder_embed_dim = 12, 1024
    cfg.decoder_ffn_embed_dim, cfg.decoder_attention_heads = 4096, 16


@register_model_architecture("transformer_lm", "transformer_lm_wiki103")
@register_model_architecture("transformer_lm", "transformer_lm_baevski_wiki103")
def transformer_lm_baevski_wiki103(cfg: TransformerLMConfig) -> None:
    """Baevski & Auli's WikiText-103 model: 16 layers of transformer_lm_big with 8 heads, adaptive input
    and softmax (bands 20000 / 60000 / rest, tied embeddings and projections); 247M parameters."""
    transformer_lm_big(cfg)
    cfg.decoder_layers, cfg.decoder_attention_heads = 16, 8
    cfg.dropout, cfg.attention_dropout, cfg.activation_dropout = 0.3, 0.1, 0.1
    cfg.adaptive_input, cfg.tie_adaptive_weights, cfg.tie_adaptive_proj = True, True, True
    cfg.adaptive_input_cutoff = cfg.adaptive_softmax_cutoff = "20000,60000"
    cfg.adaptive_softmax_dropout = 0.2
    cfg.no_decoder_final_norm = True


@register_model_architecture("transformer_lm", "transformer_lm_gbw")
@register_model_architecture("transformer_lm", "transformer_lm_baevski_gbw")
def transformer_lm_baevski_gbw(cfg: TransformerLMConfig) -> None:
    """Baevski & Auli's Billion Word base: transformer_lm_big at C=512 (adaptive flags come from the user)."""
    transformer_lm_big(cfg)
    cfg.decoder_embed_dim = 512
    cfg.dropout, cfg.attention_dropout = 0.1, 0.1
    cfg.no_decoder_final_norm = True


def _gpt(cfg: TransformerLMConfig, layers: int, dim: int, ffn: int, heads: int) -> None:
    """fairseq's GPT-1/GPT-2 archs: sinusoidal positions, untied output, dropout 0.1, GELU."""
    base_lm_architecture(cfg)
    cfg.decoder_layers, cfg.decoder_embed_dim = layers, dim
    cfg.decoder_ffn_embed_dim, cfg.decoder_attention_heads = ffn, heads
    cfg.dropout, cfg.attention_dropout = 0.1, 0.1
    cfg.activation_fn = "gelu"


@register_model_architecture("transformer_lm", "transformer_lm_gpt")
def transformer_lm_gpt(cfg: TransformerLMConfig) -> None:
    _gpt(cfg, layers=12, dim=768, ffn=3072, heads=12)


@register_model_architecture("transformer_lm", "transformer_lm_gpt2_tiny")
def transformer_lm_gpt2_tiny(cfg: TransformerLMConfig) -> None:
    _gpt(cfg, layers=2, dim=64, ffn=64, heads=1)


@register_model_architecture("transformer_lm", "transformer_lm_gpt2_small")
def transformer_lm_gpt2_small(cfg: TransformerLMConfig) -> None:
    _gpt(cfg, layers=24, dim=1024, ffn=4096, heads=16)


@register_model_architecture("transformer_lm", "transformer_lm_gpt2_medium")
def transformer_lm_gpt2_medium(cfg: TransformerLMConfig) -> None:
    _gpt(cfg, layers=36, dim=1280, ffn=5120, heads=20)


@register_model_architecture("transformer_lm", "transformer_lm_gpt2_big")
def transformer_lm_gpt2_big(cfg: TransformerLMConfig) -> None:
    _gpt(cfg, layers=48, dim=1600, ffn=6400, heads=25)


def _gpt3(cfg: TransformerLMConfig, layers: int, dim: int, heads: int) -> None:
    """fairseq's base_gpt3_architecture: FFN 4C, learned positions, tied embeddings, no dropout, GELU."""
    base_lm_architecture(cfg)
    cfg.decoder_layers, cfg.decoder_embed_dim, cfg.decoder_attention_heads = layers, dim, heads
    cfg.decoder_ffn_embed_dim = 4 * cfg.decoder_embed_dim  # 4C of the user's --decoder-embed-dim if given
    cfg.decoder_learned_pos = True
    cfg.dropout, cfg.attention_dropout = 0.0, 0.0
    cfg.activation_fn = "gelu"
    cfg.share_decoder_input_output_embed = True


@register_model_architecture("transformer_lm", "transformer_lm_gpt3_small")
def transformer_lm_gpt3_small(cfg: TransformerLMConfig) -> None:  # 125M
    _gpt3(cfg, layers=12, dim=768, heads=12)


@register_model_architecture("transformer_lm", "transformer_lm_gpt3_medium")
def transformer_lm_gpt3_medium(cfg: TransformerLMConfig) -> None:  # 350M
    _gpt3(cfg, layers=24, dim=1024, heads=16)


@register_model_architecture("transformer_lm", "transformer_lm_gpt3_large")
def transformer_lm_gpt3_large(cfg: TransformerLMConfig) -> None:  # 760M
    _gpt3(cfg, layers=24, dim=1536, heads=16)


@register_model_architecture("transformer_lm", "transformer_lm_gpt3_xl")
def transformer_lm_gpt3_xl(cfg: TransformerLMConfig) -> None:  # 1.3B
    _gpt3(cfg, layers=24, dim=2048, heads=32)


@register_model_architecture("transformer_lm", "transformer_lm_gpt3_2_7")
def transformer_lm_gpt3_2_7(cfg: TransformerLMConfig) -> None:  # 2.7B
    _gpt3(cfg, layers=32, dim=2560, heads=32)


@register_model_architecture("transformer_lm", "transformer_lm_gpt3_6_7")
def transformer_lm_gpt3_6_7(cfg: TransformerLMConfig) -> None:  # 6.7B
    _gpt3(cfg, layers=32, dim=4096, heads=32)


@register_model_architecture("transformer_lm", "transformer_lm_gpt3_13")
def transformer_lm_gpt3_13(cfg: TransformerLMConfig) -> None:  # 13B
    _gpt3(cfg, layers=40, dim=5120, heads=40)


@register_model_architecture("transformer_lm", "transformer_lm_gpt3_175")
def transformer_lm_gpt3_175(cfg: TransformerLMConfig) -> None:  # 175B
    _gpt3(cfg, layers=96, dim=12288, heads=96)


def _megatron(cfg: TransformerLMConfig, ffn: int) -> None:
    """fairseq's model_parallel archs (fairseq/model_parallel/models/transformer_lm.py), meant for
    ``--model-parallel-size``: 72 x 3072, 32 heads, GELU, dropout and attention dropout 0.1."""
    base_lm_architecture(cfg)
    cfg.decoder_layers, cfg.decoder_embed_dim = 72, 3072
    cfg.decoder_ffn_embed_dim, cfg.decoder_attention_heads = ffn, 32
    cfg.dropout, cfg.attention_dropout = 0.1, 0.1
    cfg.activation_fn = "gelu"


@register_model_architecture("transformer_lm", "transformer_lm_megatron")
def transformer_lm_megatron(cfg: TransformerLMConfig) -> None:
    _megatron(cfg, ffn=3072 * 4)


@register_model_architecture("transformer_lm", "transformer_lm_megatron_11b")
def transformer_lm_megatron_11b(cfg: TransformerLMConfig) -> None:
    _megatron(cfg, ffn=3072 * 6)


__all__ = sorted(name for name in dir() if name.startswith(("transformer_lm", "base_lm")))
