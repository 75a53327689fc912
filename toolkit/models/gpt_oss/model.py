"""The gpt-oss decoder: the MoE family's model (``toolkit.models.moe``: the routers' losses and loads beside the
output, expert parallelism, the accounting of active parameters) with gpt-oss's blocks: pre-norm, attention with
biases on every projection and one learned sink logit per head (``common.attention.Attention(sinks=True)``),
local and global layers as ``--layer-types`` says, and a mixture of experts whose router and experts have biases.

- Router (:class:`TopKLogitRouter`): logits ``W x + b``, the k largest kept and their softmax the weights (equal to
  the softmax over all E renormalized over the k kept); the balance loss reads the softmax over all E.
- Experts (:class:`ClampedSwiGLUExperts`): per expert ``down((up + 1) * g * sigmoid(alpha g)) + b_down``, with
  ``g = min(gate, limit)`` and ``up`` clamped to [-limit, limit]; gate and up each with their bias.

Parameter names are Hugging Face's inside the attention (``self_attn.sinks``, ``self_attn.o_proj.bias``); the
router is the MoE block's ``mlp.gate`` (``weight``, ``bias``: Hugging Face's ``mlp.router``), the experts stacked
as the MoE family's (``gate_proj``, ``up_proj`` [E, F, C], ``down_proj`` [E, C, F]) with their biases
(``gate_proj_bias``, ``up_proj_bias`` [E, F], ``down_proj_bias`` [E, C]); ``hf.py`` interleaves gate and up into
Hugging Face's ``gate_up_proj`` [E, C, 2F] and back.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.core.registry import register_model
from toolkit.models.common.blocks import PreNormBlock
from toolkit.models.common.moe import EXPERT_PROJECTIONS, MoE, GroupedExperts, Router, Routing, grouped_matmul
from toolkit.models.common.rotary_decoder import decoder_attention
from toolkit.models.gpt_oss.config import GptOssConfig, check_gpt_oss_shapes
from toolkit.models.gpt_oss.hf import GptOssAdapter
from toolkit.models.gpt_oss.parallel import tensor_parallel_plan
from toolkit.models.moe.model import MoELanguageModel

EXPERT_BIASES = ("gate_proj_bias", "up_proj_bias", "down_proj_bias")


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's SwiGLU: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit)."""
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(alpha * gate)


class TopKLogitRouter(Router):
    """The router of gpt-oss: biased logits, the softmax over each token's k largest (module docstring)."""

    def __init__(self, dim: int, num_experts: int, top_k: int):
        super().__init__(dim, num_experts, top_k, "softmax", renormalize=True)
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x, self.weight, self.bias).float()
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return Routing(top.softmax(-1).to(x.dtype), experts, logits, logits.softmax(-1))


def _per_row(bias: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """bias [E, out] as one row per input row of runs of ``counts`` [E] rows."""
    return bias.repeat_interleave(counts, dim=0, output_size=int(counts.sum()))


class ClampedSwiGLUExperts(GroupedExperts):
    """E experts of the clamped SwiGLU with biases, stacked (module docstring); placed over expert-parallel ranks
    as the MoE family's, the biases with their experts."""

    STACKS = EXPERT_PROJECTIONS + EXPERT_BIASES

    def __init__(self, num_experts: int, dim: int, hidden: int, limit: float, alpha: float):
        super().__init__(num_experts, dim, hidden, "silu")
        self.limit, self.alpha = limit, alpha
        self.gate_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
        self.up_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, dim))

    def run(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        gate = grouped_matmul(rows, self.gate_proj, counts) + _per_row(self.gate_proj_bias, counts)
        up = grouped_matmul(rows, self.up_proj, counts) + _per_row(self.up_proj_bias, counts)
        hidden = clamped_swiglu(gate, up, self.limit, self.alpha)
        return grouped_matmul(hidden, self.down_proj, counts) + _per_row(self.down_proj_bias, counts)

    def every_expert(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        combine = torch.zeros(x.size(0), self.num_experts, dtype=x.dtype, device=x.device)
        combine = combine.scatter(1, routing.experts, routing.weights)  # [N, E]
        gate = torch.einsum("nc,efc->enf", x, self.gate_proj) + self.gate_proj_bias[:, None]
        up = torch.einsum("nc,efc->enf", x, self.up_proj) + self.up_proj_bias[:, None]
        hidden = clamped_swiglu(gate, up, self.limit, self.alpha)
        out = torch.einsum("enf,ecf->enc", hidden, self.down_proj) + self.down_proj_bias[:, None]
        return torch.einsum("enc,ne->nc", out, combine)


class GptOssMoE(MoE):
    """The MoE block with gpt-oss's router and experts (its statistics, losses and hooks the MoE block's)."""

    def __init__(self, cfg: GptOssConfig, index: int):
        width, hidden = cfg.decoder_embed_dim, cfg.moe_ffn_embed_dim
        super().__init__(
            width,
            hidden,
            num_experts=cfg.moe_num_experts,
            top_k=cfg.moe_top_k,
            renormalize=True,
            idle_warning_updates=cfg.moe_idle_warning_updates,
            name=f"layers.{index}.mlp",
        )
        self.gate = TopKLogitRouter(width, cfg.moe_num_experts, cfg.moe_top_k)
        experts = ClampedSwiGLUExperts(cfg.moe_num_experts, width, hidden, cfg.moe_swiglu_limit, cfg.moe_swiglu_alpha)
        self.experts = experts


@register_model("gpt_oss", dataclass=GptOssConfig)
class GptOssLanguageModel(MoELanguageModel):
    """The gpt-oss decoder behind the toolkit's model interface (module docstring)."""

    HF_ADAPTER = GptOssAdapter
    PLAN = staticmethod(tensor_parallel_plan)

    @staticmethod
    def check_options(cfg: GptOssConfig) -> None:
        check_gpt_oss_shapes(cfg)

    def build_block(self, cfg: GptOssConfig, index: int, window: Optional[int]) -> PreNormBlock:
        attention = decoder_attention(cfg, window, sinks=True, output_bias=True)
        return PreNormBlock(attention, GptOssMoE(cfg, index), norm=self.width_norm)

    def initial_value(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """The MoE family's rules; the experts' biases 0 as every bias, the sinks N(0, init_std) as transformers
        draws them."""
        if name.endswith(EXPERT_BIASES):
            return torch.zeros(shape)
        if name.endswith("self_attn.sinks"):
            return torch.empty(shape).normal_(0.0, self.cfg.init_std, generator=generator)
        return super().initial_value(name, shape, generator)

    def parameter_roles(self) -> Dict[str, str]:
        """The decoder's roles; the experts' stacked biases are biases (not matrices for Muon)."""
        roles = super().parameter_roles()
        return {name: "bias" if name.endswith(EXPERT_BIASES) else role for name, role in roles.items()}

    def expert_parameters(self) -> int:
        """The stacked experts' weights and biases (what a token uses k / E of)."""
        stacks = tuple(f"mlp.experts.{name}" for name in ClampedSwiGLUExperts.STACKS)
        return sum(p.numel() for name, p in self.named_parameters() if name.endswith(stacks))
