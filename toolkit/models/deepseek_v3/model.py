"""The DeepSeek-V3 decoder (DeepSeek-V3, Moonlight, Kimi K2): the MoE family's model (``toolkit.models.moe``:
the routers' losses and loads beside the output, expert parallelism, the accounting of active parameters) with
DeepSeek's blocks: pre-norm, multi-head latent attention (``common.attention.LatentAttention``), a dense SwiGLU
MLP in the first ``--first-k-dense-replace`` layers and DeepSeekMoE in the others (``common.moe.MoE``: sigmoid
scores, group-limited top-k, the correction bias, the routed scaling factor, shared experts).

Parameter names are Hugging Face's ``DeepseekV3ForCausalLM`` ones inside a block (``self_attn.q_a_proj``,
``self_attn.kv_a_proj_with_mqa``, ``mlp.shared_experts.gate_proj`` ...; the router's correction bias is the
MoE block's ``mlp.gate.expert_bias``), the experts stacked [E, ...], so ``hf.py`` renames, stacks and permutes
the rotary rows only.

``--mtp-depth D`` adds D multi-token prediction depths (``common/mtp.py``) under ``mtp``, each a block of the
next layer index's kind (``mtp.{k}.layer``; DeepSeek-V3's is a MoE layer) between its joining projection and its
norm. In training, given the targets (``target=``, which the criterion passes to a model that ``reads_targets``),
their mean loss is an auxiliary term (``mtp_loss``) beside the routers'; otherwise they do not run.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from toolkit.core.registry import register_model
from toolkit.models.common.attention import LatentAttention, latent_attention_scale
from toolkit.models.common.blocks import PreNormBlock
from toolkit.models.common.moe import MoE
from toolkit.models.common.mtp import MultiTokenPrediction
from toolkit.models.common.options import head_dim
from toolkit.models.deepseek_v3.config import DeepSeekV3Config, check_deepseek_shapes, qk_head_dim
from toolkit.models.deepseek_v3.hf import DeepSeekV3Adapter
from toolkit.models.deepseek_v3.parallel import tensor_parallel_plan
from toolkit.models.moe.model import MoELanguageModel, moe_experts
from toolkit.models.outputs import with_aux_loss

LATENT_PROJECTIONS = (
    "q_proj.weight",
    "q_a_proj.weight",
    "q_b_proj.weight",
    "kv_a_proj_with_mqa.weight",
    "kv_b_proj.weight",
)


def latent_attention(cfg: DeepSeekV3Config, window: Optional[int]) -> LatentAttention:
    """A block's multi-head latent attention of ``cfg``, its softmax scale DeepSeek's (YaRN's mscale squared)."""
    factor = cfg.rope_scaling_factor if cfg.rope_scaling == "yarn" else None
    return LatentAttention(
        cfg.decoder_embed_dim,
        cfg.decoder_attention_heads,
        kv_rank=cfg.kv_lora_rank,
        rope_dim=head_dim(cfg),
        nope_dim=cfg.qk_nope_head_dim,
        v_dim=cfg.v_head_dim,
        q_rank=cfg.q_lora_rank,
        scale=latent_attention_scale(qk_head_dim(cfg), factor, cfg.rope_mscale_all_dim),
        window=window,
    )


def deepseek_moe(cfg: DeepSeekV3Config, index: int, sequence_balance: bool = False) -> MoE:
    """Layer ``index``'s experts: DeepSeekMoE's router (groups, scaling, the correction bias always present);
    ``sequence_balance``: its sequence-wise balance loss computed (``MoE.aux``)."""
    return moe_experts(
        cfg,
        index,
        groups=cfg.moe_n_group,
        top_groups=cfg.moe_topk_group,
        routed_scaling=cfg.moe_routed_scaling_factor,
        routing_bias=True,
        sequence_balance=sequence_balance,
    )


@register_model("deepseek_v3", dataclass=DeepSeekV3Config)
class DeepSeekV3LanguageModel(MultiTokenPrediction, MoELanguageModel):
    """The DeepSeek-V3-class decoder behind the toolkit's model interface: latent attention, the first layers
    dense, DeepSeekMoE after them."""

    HF_ADAPTER = DeepSeekV3Adapter
    PLAN = staticmethod(tensor_parallel_plan)

    @staticmethod
    def check_options(cfg: DeepSeekV3Config) -> None:
        check_deepseek_shapes(cfg)

    def build_block(self, cfg: DeepSeekV3Config, index: int, window: Optional[int]) -> PreNormBlock:
        dense = index < cfg.first_k_dense_replace
        mlp = self.gated_mlp() if dense else deepseek_moe(cfg, index, cfg.moe_seq_aux_loss_coef > 0)
        return PreNormBlock(latent_attention(cfg, window), mlp, norm=self.width_norm)

    def _with_router_terms(self, out: Any):
        """The MoE family's router terms; with ``--moe-seq-aux-loss-coef``, the sequence-wise balance loss too (the
        mean over the layers), ``moe_seq_aux_loss``."""
        layers = [m for m in self.moe_layers() if "sequence_balance" in m.aux]
        term = sum(m.aux["sequence_balance"] for m in layers) / len(layers) if layers else None
        out = super()._with_router_terms(out)
        return out if term is None else with_aux_loss(out, "moe_seq_aux_loss", term, self.cfg.moe_seq_aux_loss_coef)

    def initial_value(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """The MoE family's rules (and the depths'); the latent attention's projections as the other projections."""
        if name.endswith(LATENT_PROJECTIONS):
            return torch.empty(shape).normal_(0.0, self.cfg.init_std, generator=generator)
        return super().initial_value(name, shape, generator)

    # No cached ONNX decoder yet: its graph takes each layer's key/value heads, latent attention caches a latent
    # and a shared rotary key (``--kv-cache`` then names the families that have one).
    onnx_cached_decoder = None

    def flops_per_token(self, seq_len: int) -> int:
        """6N over the active matmul weights, plus attention's q k^T over Dn + Dr features and its sum over Dv,
        forward and backward (PaLM's 12 L H D T with D the mean of the two widths)."""
        cfg = self.cfg
        attention = 6 * cfg.decoder_layers * cfg.decoder_attention_heads * (qk_head_dim(cfg) + cfg.v_head_dim) * seq_len
        return int(6 * self.num_matmul_parameters() + attention)
