"""The mixture-of-experts decoder: ``common/rotary_decoder.py``'s model with pre-norm blocks whose MLP is a
``MoE`` (``toolkit.models.common.moe``).

Parameter names are Hugging Face's Qwen3-MoE / OLMoE ones (``layers.i.mlp.gate.weight`` the router,
``layers.i.mlp.experts.{gate,up,down}_proj`` the experts stacked [E, ...]), so ``hf.py`` only stacks and
unstacks the per-expert tensors. In training the forward returns ``(logits, extra)`` (``toolkit.models.outputs``):
the load-balancing and router z-losses, each the mean over the layers with its ``--moe-*-coef``, and per layer
the busiest expert's load over the mean (``moe_max_load_<layer>``), plus the tokens dropped (``moe_dropped``,
0: dispatch is dropless). In evaluation it returns the logits alone, as the dense families.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from toolkit.core.registry import register_model
from toolkit.models.common.attention import Attention
from toolkit.models.common.blocks import PreNormBlock
from toolkit.models.common.moe import MoE
from toolkit.models.common.rotary_decoder import RotaryDecoderLM, decoder_attention
from toolkit.models.fused_loss import LossTarget
from toolkit.models.moe.config import MoEConfig, check_moe_shapes
from toolkit.models.moe.hf import MoEAdapter
from toolkit.models.moe.parallel import tensor_parallel_plan
from toolkit.models.outputs import SUMMED_NLL, aux_losses_of, metrics_of, summed_nll_of, with_extras

EXPERT_WEIGHTS = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")


def moe_attention(cfg: MoEConfig, window: Optional[int]) -> Attention:
    """Grouped-query attention with QK-norm per head (Qwen3-MoE) or over the whole projections (OLMoE)."""
    return decoder_attention(cfg, window, qk_norm_per_head=not cfg.qk_norm_full_width)


def moe_experts(cfg: MoEConfig, index: int, **router: Any) -> MoE:
    """Layer ``index``'s mixture of experts of ``cfg``; ``router``: a family's own router settings (``MoE``'s
    keywords: DeepSeek's groups and scaling)."""
    return MoE(
        cfg.decoder_embed_dim,
        cfg.moe_ffn_embed_dim,
        num_experts=cfg.moe_num_experts,
        top_k=cfg.moe_top_k,
        score_func=cfg.moe_score_func,
        renormalize=cfg.moe_renormalize,
        shared_hidden=cfg.moe_shared_ffn_embed_dim,
        bias_update_rate=cfg.moe_bias_update_rate,
        idle_warning_updates=cfg.moe_idle_warning_updates,
        name=f"layers.{index}.mlp",
        activation=cfg.mlp_activation,
        **router,
    )


def weighted(term: torch.Tensor, coefficient: float) -> Tuple[torch.Tensor, float]:
    """An auxiliary term and its coefficient, as the criterion takes them; a term weighted 0 is only logged, so it
    is detached: backward does not run through the routers' statistics for a zero gradient."""
    return (term if coefficient else term.detach()), coefficient


@register_model("moe", dataclass=MoEConfig)
class MoELanguageModel(RotaryDecoderLM):
    """Qwen3-MoE / OLMoE / Mixtral-style sparse decoder behind the toolkit's model interface: pre-norm blocks whose
    MLP is a mixture of experts."""

    supports_expert_parallel = True  # the experts of each layer are spread by toolkit.distributed.expert_parallel
    supports_pipeline_parallel = True  # toolkit.distributed.pipeline runs its blocks and its routers' terms by stage
    HF_ADAPTER = MoEAdapter
    PLAN = staticmethod(tensor_parallel_plan)

    @staticmethod
    def check_options(cfg: MoEConfig) -> None:
        check_moe_shapes(cfg)

    def build_block(self, cfg: MoEConfig, index: int, window: Optional[int]) -> PreNormBlock:
        return PreNormBlock(moe_attention(cfg, window), moe_experts(cfg, index), norm=self.width_norm)

    def forward(
        self,
        tokens: torch.Tensor,
        incremental_state: Optional[Dict] = None,
        document_ids: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        context_parallel: Any = None,
        loss_target: Optional[LossTarget] = None,
    ):
        """The shared forward (``context_parallel``: this rank's chunks of the sequences); in training the routers'
        terms beside the output, their statistics taken over the whole sequences (every cp rank's tokens)."""
        for moe in self.moe_layers():
            moe.context_group = None if context_parallel is None else context_parallel.group
        out = super().forward(tokens, incremental_state, document_ids, positions, context_parallel, loss_target)
        if not self.training:
            return out
        return self._with_router_terms(out)

    def moe_layers(self) -> List[MoE]:
        """The MoE modules in layer order (found through any wrapper: FSDP2, checkpointing, compile)."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def router_terms(self) -> Tuple[Dict[str, Tuple[torch.Tensor, float]], Dict[str, Any]]:
        """The auxiliary losses and metrics of the layers that ran a training forward since they were last taken
        (``_with_router_terms``' terms without an output): what a pipeline stage sends through its own backward."""
        terms = self._with_router_terms(None)
        return aux_losses_of(terms), metrics_of(terms)

    def _with_router_terms(self, out: Any):
        """``out`` (logits, or the fused head's ``(None, {"summed_nll": ...})``) with the routers' terms added."""
        layers = [m for m in self.moe_layers() if m.aux]
        if not layers:
            return out
        summed_nll = summed_nll_of(out)
        logits, kept = (None, {SUMMED_NLL: summed_nll}) if summed_nll is not None else (out, {})
        L = len(layers)
        aux = {
            "moe_aux_loss": weighted(sum(m.aux["balance"] for m in layers) / L, self.cfg.moe_aux_loss_coef),
            "moe_z_loss": weighted(sum(m.aux["z"] for m in layers) / L, self.cfg.moe_z_loss_coef),
        }
        metrics = {f"moe_max_load_{i}": m.load["max_load"] for i, m in enumerate(layers)}
        metrics["moe_dropped"] = sum(m.load["dropped"] for m in layers)
        for m in layers:
            m.aux, m.load = {}, {}
        return with_extras(logits, aux, metrics, **kept)

    def initial_value(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """The dense families' rules; stacked experts as their Linear counterparts (down_proj scaled by
        1/sqrt(2 x layers)), the router as a projection."""
        if name.endswith(EXPERT_WEIGHTS) or name.endswith("mlp.gate.weight"):
            std = self.cfg.init_std
            if name.endswith("down_proj"):
                std = std / math.sqrt(2 * self.cfg.decoder_layers)
            return torch.empty(shape).normal_(0.0, std, generator=generator)
        return super().initial_value(name, shape, generator)

    def meta_traceable_options(self) -> Dict[str, Any]:
        """toolkit-plan's 1- and 2-layer copies (``MetaTraceable``): every layer a MoE layer where the family makes
        its first layers dense (``first_k_dense_replace``: the copies would otherwise be dense, or refused as more
        dense layers than layers), so one layer's activations are an expert layer's, the larger."""
        return {"first_k_dense_replace": 0} if getattr(self.cfg, "first_k_dense_replace", 0) else {}

    # ---- accounting: a token uses k of the E experts ----

    def expert_parameters(self) -> int:
        return sum(p.numel() for name, p in self.named_parameters() if name.endswith(EXPERT_WEIGHTS))

    def active_parameters(self) -> int:
        """Parameters one token uses: all but the (E - k) / E of the experts it is not routed to (the
        embedding counted, as in the published "active" figures)."""
        idle = self.expert_parameters() * (self.cfg.moe_num_experts - self.cfg.moe_top_k) // self.cfg.moe_num_experts
        return sum(p.numel() for p in self.parameters()) - idle

    def num_matmul_parameters(self) -> int:
        """The N of 6N over the *active* experts: the dense count less the experts a token is not routed to."""
        idle = self.expert_parameters() * (self.cfg.moe_num_experts - self.cfg.moe_top_k) // self.cfg.moe_num_experts
        return super().num_matmul_parameters() - idle
