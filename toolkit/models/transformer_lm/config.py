"""Options of the ``transformer_lm`` family (fairseq's ``TransformerLanguageModelConfig``) and its activations' names.

Each field is one ``--flag`` (the help text is fairseq's); the named architectures (``archs.py``)
set values on a fresh config and the user's flags override them. No torch here: ``--help`` reads this module
(the activation functions are ``toolkit.models.common.mlp.ACTIVATIONS``, the one table).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from toolkit.config.flag_types import positive_int, probability

ACTIVATION_NAMES = ("relu", "gelu", "gelu_accurate", "gelu_fast", "tanh", "swish", "linear")


@dataclass
class TransformerLMConfig:
    decoder_layers: int = field(default=6, metadata={"type": positive_int, "help": "num decoder layers"})
    decoder_embed_dim: int = field(default=512, metadata={"type": positive_int, "help": "decoder embedding dimension"})
    decoder_ffn_embed_dim: int = field(
        default=2048, metadata={"type": positive_int, "help": "decoder embedding dimension for FFN"}
    )
    decoder_attention_heads: int = field(
        default=8, metadata={"type": positive_int, "help": "num decoder attention heads"}
    )
    decoder_normalize_before: bool = field(
        default=True,
        metadata={
            "help": "apply layernorm before each decoder block (pre-norm; the named archs "
            "set it, --arch transformer_lm is post-norm as in fairseq)"
        },
    )
    no_decoder_final_norm: bool = field(
        default=False, metadata={"help": "don't add an extra layernorm after the last decoder block"}
    )
    share_decoder_input_output_embed: bool = field(
        default=False, metadata={"help": "share decoder input and output embeddings"}
    )
    no_token_positional_embeddings: bool = field(
        default=False, metadata={"help": "if set, disables positional embeddings (outside self attention)"}
    )
    decoder_learned_pos: bool = field(
        default=False, metadata={"help": "use learned positional embeddings in the decoder"}
    )
    no_scale_embedding: bool = field(default=False, metadata={"help": "if True, dont scale embeddings"})
    activation_fn: str = field(
        default="relu", metadata={"help": "activation function to use", "choices": list(ACTIVATION_NAMES)}
    )
    dropout: float = field(default=0.1, metadata={"type": probability, "help": "dropout probability"})
    attention_dropout: float = field(
        default=0.0, metadata={"type": probability, "help": "dropout probability for attention weights"}
    )
    activation_dropout: float = field(
        default=0.0, metadata={"type": probability, "help": "dropout probability after activation in FFN."}
    )
    relu_dropout: float = field(
        default=0.0,
        metadata={"type": probability, "help": "fairseq's older name of --activation-dropout, used when that is 0"},
    )
    max_target_positions: Optional[int] = field(
        default=None,
        metadata={
            "type": positive_int,
            "help": "max number of tokens in the target sequence (default: --tokens-per-sample)",
        },
    )
    # Embedding and output sizes (fairseq's project_in_dim / project_out_dim when they differ from C).
    decoder_input_dim: Optional[int] = field(
        default=None,
        metadata={
            "help": "decoder input dimension (default: 512 under --arch transformer_lm, as in "
            "fairseq; --decoder-embed-dim under the named archs)"
        },
    )
    decoder_output_dim: Optional[int] = field(
        default=None,
        metadata={
            "help": "decoder output dimension (default: 512 under --arch transformer_lm, as in "
            "fairseq; --decoder-embed-dim under the named archs)"
        },
    )
    layernorm_embedding: bool = field(default=False, metadata={"help": "add layernorm to embedding"})
    # LayerDrop (see toolkit.models.layerdrop).
    decoder_layerdrop: float = field(
        default=0.0, metadata={"type": probability, "help": "LayerDrop probability for decoder"}
    )
    decoder_layers_to_keep: Optional[str] = field(
        default=None, metadata={"help": "which layers to *keep* when pruning as a comma-separated list"}
    )
    # Adaptive input and softmax (see toolkit.models.adaptive).
    adaptive_input: bool = field(default=False, metadata={"help": "if set, uses adaptive input"})
    adaptive_input_factor: float = field(
        default=4.0, metadata={"help": "adaptive input factor: band i has dimension C_in // factor**i"}
    )
    adaptive_input_cutoff: Optional[str] = field(
        default=None, metadata={"help": "comma separated list of adaptive input cutoff points."}
    )
    adaptive_softmax_cutoff: Optional[str] = field(
        default=None,
        metadata={
            "help": "comma separated list of adaptive softmax cutoff points. Must be used with adaptive_loss criterion"
        },
    )
    adaptive_softmax_dropout: float = field(
        default=0.0, metadata={"type": probability, "help": "sets adaptive softmax dropout for the tail projections"}
    )
    adaptive_softmax_factor: float = field(
        default=4.0, metadata={"help": "adaptive softmax factor: tail band i has dimension C_out // factor**(i+1)"}
    )
    tie_adaptive_weights: bool = field(
        default=False, metadata={"help": "if set, ties the weights of adaptive softmax and adaptive input"}
    )
    tie_adaptive_proj: bool = field(
        default=False, metadata={"help": "if set, ties the projection weights of adaptive softmax and adaptive input"}
    )
    # Quant-Noise (see toolkit.models.quant_noise).
    quant_noise_pq: float = field(
        default=0.0,
        metadata={
            "help": "iterative PQ quantization noise at training time: blocks of weights dropped with this probability"
        },
    )
    quant_noise_pq_block_size: int = field(
        default=8, metadata={"help": "block size of quantization noise at training time"}
    )
