"""Options of the mixture-of-experts family (``--arch moe`` and its named sizes: Qwen3-MoE, OLMoE, Mixtral).

The attention, norms and rotary embeddings take the options every rotary decoder family shares
(``toolkit.models.common.options``); every block is pre-norm and its feed-forward a ``toolkit.models.common.moe.MoE``
instead of one SwiGLU (Hugging Face's key in brackets):

``--moe-num-experts``             experts per layer (``num_experts`` / ``num_local_experts``)
``--moe-top-k``                   experts per token (``num_experts_per_tok``)
``--moe-ffn-embed-dim``           an expert's hidden width (``moe_intermediate_size``; Mixtral's
                                  ``intermediate_size``)
``--moe-score-func``              softmax (Qwen3-MoE, OLMoE, Mixtral) or sigmoid (DeepSeek-V3) router scores
``--moe-renormalize``             the k kept weights divided by their sum (``norm_topk_prob``; Mixtral always)
``--moe-shared-ffn-embed-dim``    hidden width of a shared SwiGLU expert every token goes through (0: none)
``--moe-bias-update-rate``        DeepSeek-V3's aux-loss-free balancing: the per-expert routing bias moves by
                                  this much per update towards the under-loaded experts (0: no bias)
``--moe-aux-loss-coef``           weight of the Switch/GShard load-balancing loss (``router_aux_loss_coef``)
``--moe-z-loss-coef``             weight of the router z-loss (OLMoE's ``router_z_loss_coef``)
``--moe-idle-warning-updates``    warn when an expert got no token for this many updates in a row
``--qk-norm-full-width``          QK-norm over the whole query/key projection, not per head (OLMoE)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Dict

from toolkit.config.flag_types import non_negative_float, non_negative_int, positive_int
from toolkit.core.errors import UserError
from toolkit.models.common.options import SCORE_FUNCTIONS, DecoderOptions, absent_options, check_shapes


@dataclass
class MoEConfig(DecoderOptions):
    ABSENT_OPTIONS: ClassVar[Dict[str, str]] = absent_options(
        "the MoE family", "MoE blocks always normalize before attention and the experts (RMSNorm)"
    )

    moe_num_experts: int = field(default=4, metadata={"type": positive_int, "help": "experts in each MoE layer"})
    moe_top_k: int = field(default=2, metadata={"type": positive_int, "help": "experts each token is sent to"})
    moe_ffn_embed_dim: int = field(default=64, metadata={"type": positive_int, "help": "hidden width of each expert"})
    moe_score_func: str = field(
        default="softmax",
        metadata={
            "choices": SCORE_FUNCTIONS,
            "help": "router scores: softmax over the experts, or a sigmoid per expert (DeepSeek-V3)",
        },
    )
    moe_renormalize: bool = field(
        default=False,
        metadata={
            "negatable": True,  # the named sizes of Qwen3-MoE and Mixtral set it: --no-moe-renormalize undoes it
            "help": "divide the top-k router weights by their sum (Qwen3-MoE's norm_topk_prob, Mixtral)",
        },
    )
    moe_shared_ffn_embed_dim: int = field(
        default=0,
        metadata={
            "type": non_negative_int,
            "help": "hidden width of a shared expert every token goes through (0: none)",
        },
    )
    moe_bias_update_rate: float = field(
        default=0.0,
        metadata={
            "type": non_negative_float,
            "help": "aux-loss-free balancing (DeepSeek-V3): per-update step of the routing bias towards the "
            "under-loaded experts (0: no bias)",
        },
    )
    moe_aux_loss_coef: float = field(
        default=0.01,
        metadata={
            "type": non_negative_float,
            "help": "weight of the load-balancing loss E * sum_i f_i P_i (Switch/GShard), logged as moe_aux_loss",
        },
    )
    moe_z_loss_coef: float = field(
        default=0.0,
        metadata={
            "type": non_negative_float,
            "help": "weight of the router z-loss mean(logsumexp(router logits)^2), logged as moe_z_loss",
        },
    )
    moe_idle_warning_updates: int = field(
        default=100,
        metadata={"type": positive_int, "help": "warn when an expert receives no token for this many updates in a row"},
    )
    qk_norm_full_width: bool = field(
        default=False,
        metadata={
            "help": "with --qk-norm: one RMSNorm over the whole query (key) projection instead of each head (OLMoE)"
        },
    )


def check_moe_shapes(cfg: MoEConfig) -> None:
    """The rotary decoder's checks, then the experts' (one line each)."""
    check_shapes(cfg)
    if cfg.moe_top_k > cfg.moe_num_experts:
        raise UserError(
            f"--moe-top-k {cfg.moe_top_k}: a token cannot go to more than the --moe-num-experts "
            f"{cfg.moe_num_experts} experts"
        )
    negative = [
        name
        for name in ("moe_shared_ffn_embed_dim", "moe_bias_update_rate", "moe_aux_loss_coef", "moe_z_loss_coef")
        if getattr(cfg, name) < 0
    ]
    if negative:  # a config not parsed from flags (a checkpoint's); the flags' types refuse these at parse time
        flag = "--" + negative[0].replace("_", "-")
        raise UserError(f"{flag} {getattr(cfg, negative[0])}: must be 0 or more")
