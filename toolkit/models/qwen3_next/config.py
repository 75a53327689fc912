"""Options of the Qwen3-Next family (``--arch qwen3_next`` and its named sizes). The MoE family's options
(``toolkit.models.moe.config``: experts, router, shared expert) and the rotary decoder's (the full-attention
layers: heads, head size, ``--partial-rotary-factor``), plus the linear-attention layers' (Hugging Face's key in
brackets):

``--full-attention-interval``     every N-th layer (N-1, 2N-1, ...) is full attention, the others gated DeltaNet
                                  (``full_attention_interval``; ``layer_types``)
``--linear-num-key-heads``        query/key heads of a gated DeltaNet layer (``linear_num_key_heads``)
``--linear-num-value-heads``      its value heads, a multiple of the key heads (``linear_num_value_heads``)
``--linear-key-head-dim``         their sizes (``linear_key_head_dim``, ``linear_value_head_dim``)
``--linear-value-head-dim``
``--linear-conv-kernel-dim``      taps of the short causal convolution on q, k, v (``linear_conv_kernel_dim``)
``--mtp-depth``                   multi-token prediction depths after the decoder (``num_nextn_predict_layers``,
                                  Qwen3.5's ``mtp_num_hidden_layers``; ``toolkit.models.common.mtp``), each a
                                  full-attention layer; trained only; 0: none
``--mtp-loss-coef``               their mean loss's weight in the training loss, logged as ``mtp_loss``

The shared expert (``--moe-shared-ffn-embed-dim``) is scaled per token by sigmoid(``shared_expert_gate`` x).
Qwen3.5 is the same decoder with two differences, each a flag its sizes set: ``--linear-split-projections`` (the
linear layers project q | k | v, z, b and a each with its own matrix) and, for the dense Qwen3.5 models,
``--dense-mlp`` (a SwiGLU of ``--decoder-ffn-embed-dim`` in every layer instead of the experts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from toolkit.config.flag_types import positive_int
from toolkit.core.errors import UserError
from toolkit.models.deepseek_v3.config import deepseek_option
from toolkit.models.moe.config import MoEConfig, check_moe_shapes


@dataclass
class Qwen3NextConfig(MoEConfig):
    full_attention_interval: int = field(
        default=4, metadata={"type": positive_int, "help": "every N-th layer is full attention, the others linear"}
    )
    linear_num_key_heads: int = field(default=2, metadata={"type": positive_int, "help": "gated DeltaNet key heads"})
    linear_num_value_heads: int = field(
        default=4, metadata={"type": positive_int, "help": "gated DeltaNet value heads (a multiple of the key heads)"}
    )
    linear_key_head_dim: int = field(default=16, metadata={"type": positive_int, "help": "gated DeltaNet key size"})
    linear_value_head_dim: int = field(default=16, metadata={"type": positive_int, "help": "gated DeltaNet value size"})
    linear_conv_kernel_dim: int = field(
        default=4, metadata={"type": positive_int, "help": "taps of the causal convolution on q, k, v"}
    )
    linear_split_projections: bool = field(
        default=False,
        metadata={
            "help": "the linear layers' in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (Qwen3.5), not in_proj_qkvz/ba"
        },
    )
    dense_mlp: bool = field(
        default=False,
        metadata={"help": "a dense SwiGLU MLP in every layer instead of the experts (the dense Qwen3.5 models)"},
    )
    mtp_depth: int = deepseek_option("mtp_depth")
    mtp_loss_coef: float = deepseek_option("mtp_loss_coef")


def linear_layers(cfg: Qwen3NextConfig) -> List[bool]:
    """Whether each layer is gated DeltaNet (else full attention): all but every ``full_attention_interval``-th."""
    return [(i + 1) % cfg.full_attention_interval != 0 for i in range(cfg.decoder_layers)]


def check_qwen3_next_shapes(cfg: Qwen3NextConfig) -> None:
    """The MoE family's checks, then the linear layers' (one line each)."""
    check_moe_shapes(cfg)
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise UserError(
            f"--linear-num-value-heads {cfg.linear_num_value_heads}: must be a multiple of --linear-num-key-heads "
            f"{cfg.linear_num_key_heads} (each key head serves a whole group of value heads)"
        )
    if cfg.sliding_window is not None or cfg.layer_types is not None:
        raise UserError(
            "--sliding-window/--layer-types: the Qwen3-Next family's layers are gated DeltaNet or full attention "
            "(--full-attention-interval); drop the window flags"
        )
    if cfg.moe_shared_ffn_embed_dim < 1 and not cfg.dense_mlp:
        raise UserError(
            "--moe-shared-ffn-embed-dim 0: Qwen3-Next's MoE layers have a gated shared expert; give its width"
        )
