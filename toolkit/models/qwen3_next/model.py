"""The Qwen3-Next decoder: the MoE family's model (``toolkit.models.moe``: the routers' losses and loads beside the
output, the accounting of active parameters) with Qwen3-Next's blocks: pre-norm with zero-centered RMSNorms
(scale 1 + w), the token mixer gated DeltaNet (``common.attention.GatedDeltaNet``) in all but every
``--full-attention-interval``-th layer and gated full attention (``common.attention.GatedAttention``: QK-norm per
head, a quarter of each head rotated) in those; every MLP a mixture of experts whose shared expert is scaled by a
sigmoid gate per token. Qwen3.5 is this decoder with the linear layers' projections split and, in its dense
models, a SwiGLU MLP in every layer (``--linear-split-projections``, ``--dense-mlp``).

Parameter names are Hugging Face's inside a block except the token mixer's module, ``self_attn`` in every layer
(Hugging Face's ``linear_attn`` in the linear ones) and the shared expert (``mlp.shared_experts``, its gate
``mlp.shared_experts.expert_gate``): ``hf.py`` renames them.

The forward hands each kind of layer what it needs of the documents: the full-attention layers the mask, the
linear ones the [B, T] document starts (their state restarts there). Under context parallelism both take the
shard (the linear layers compose the state across the cp ranks). Decoding keeps a ``RecurrentState`` per linear
layer and a ``KVCache`` per full one.

``--mtp-depth D`` adds D multi-token prediction depths (``common/mtp.py``) under ``mtp``, each a gated
full-attention layer with the layers' MLP between its joining projection and its norm (all zero-centered), as
Qwen3-Next's and Qwen3.5's releases hold one; trained only.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Union

import torch
import torch.nn as nn

from toolkit.core.registry import register_model
from toolkit.models.common.attention import GatedAttention, GatedDeltaNet, KVCache, RecurrentState, attention_mask
from toolkit.models.common.blocks import PreNormBlock
from toolkit.models.common.mlp import GatedFeedForward
from toolkit.models.common.moe import MoE
from toolkit.models.common.mtp import MultiTokenPrediction
from toolkit.models.common.options import head_dim, kv_heads
from toolkit.models.fused_loss import LossTarget
from toolkit.models.moe.model import MoELanguageModel, moe_experts
from toolkit.models.qwen3_next.config import Qwen3NextConfig, check_qwen3_next_shapes, linear_layers
from toolkit.models.qwen3_next.hf_vision_language import Qwen3NextReleasedAdapter
from toolkit.models.qwen3_next.parallel import tensor_parallel_plan

LINEAR_INPUTS = (
    "in_proj_qkvz.weight",
    "in_proj_ba.weight",
    "in_proj_qkv.weight",
    "in_proj_z.weight",
    "in_proj_b.weight",
    "in_proj_a.weight",
    "expert_gate.weight",
)


class SigmoidGatedExpert(GatedFeedForward):
    """Qwen3-Next's shared expert: the SwiGLU's output scaled per token by sigmoid(``expert_gate`` x)."""

    def __init__(self, dim: int, hidden: int, activation: str = "silu"):
        super().__init__(dim, hidden, activation)
        self.expert_gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.expert_gate(x)) * super().forward(x)


def qwen3_next_experts(cfg: Qwen3NextConfig, index: int) -> MoE:
    """Layer ``index``'s experts: the MoE family's, the shared expert gated."""
    moe = moe_experts(cfg, index)
    moe.shared_experts = SigmoidGatedExpert(cfg.decoder_embed_dim, cfg.moe_shared_ffn_embed_dim, cfg.mlp_activation)
    return moe


def token_mixer(cfg: Qwen3NextConfig, linear: bool) -> nn.Module:
    """A layer's gated DeltaNet (``linear``) or gated full attention."""
    if linear:
        return GatedDeltaNet(
            cfg.decoder_embed_dim,
            cfg.linear_num_key_heads,
            cfg.linear_num_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
            conv_kernel=cfg.linear_conv_kernel_dim,
            eps=cfg.rms_norm_eps,
            split_projections=cfg.linear_split_projections,
        )
    return GatedAttention(
        cfg.decoder_embed_dim,
        cfg.decoder_attention_heads,
        kv_heads(cfg),
        head_dim(cfg),
        qk_norm_eps=cfg.rms_norm_eps,
        qk_norm_unit_offset=True,
    )


def document_starts(document_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """[B, T] bool: a document begins at this position (not the row's first), or None without documents."""
    if document_ids is None:
        return None
    starts = torch.zeros_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


@register_model("qwen3_next", dataclass=Qwen3NextConfig)
class Qwen3NextLanguageModel(MultiTokenPrediction, MoELanguageModel):
    """The Qwen3-Next decoder behind the toolkit's model interface (see the module docstring)."""

    HF_ADAPTER = Qwen3NextReleasedAdapter
    PLAN = staticmethod(tensor_parallel_plan)
    unit_offset_norms = True
    onnx_cached_decoder = None  # the cached ONNX graph takes key/value heads; the linear layers keep a state

    @staticmethod
    def check_options(cfg: Qwen3NextConfig) -> None:
        check_qwen3_next_shapes(cfg)

    def build_block(self, cfg: Qwen3NextConfig, index: int, window: Optional[int]) -> PreNormBlock:
        mixer = token_mixer(cfg, linear_layers(cfg)[index])
        mlp = self.gated_mlp() if cfg.dense_mlp else qwen3_next_experts(cfg, index)
        return PreNormBlock(mixer, mlp, norm=self.width_norm)

    def prediction_block(self, cfg: Qwen3NextConfig, k: int) -> PreNormBlock:
        """Depth k's block: gated full attention and the layers' MLP (Qwen3-Next's MTP layer)."""
        mlp = self.gated_mlp() if cfg.dense_mlp else qwen3_next_experts(cfg, cfg.decoder_layers + k)
        return PreNormBlock(token_mixer(cfg, linear=False), mlp, norm=self.width_norm)

    def decoder_forward(
        self,
        tokens: torch.Tensor,
        incremental_state: Optional[Dict] = None,
        document_ids: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        context_parallel: Any = None,
        loss_target: Optional[LossTarget] = None,
    ):
        """The rotary decoder's forward (its arguments), each layer given its kind's view of the documents."""
        for moe in self.moe_layers():
            moe.context_group = None if context_parallel is None else context_parallel.group
        start, T = self._first_position(tokens, incremental_state), tokens.size(1)
        x = self.embed(tokens)
        cos, sin = self.rope_rows(None, start, T, positions)
        mask = starts = None
        if context_parallel is None:
            mask = attention_mask(document_ids, T, tokens.device, head_dim=head_dim(self.cfg))
            starts = document_starts(document_ids)
        kinds = linear_layers(self.cfg)
        for layer, linear, cache in zip(self.layers, kinds, self._layer_caches(incremental_state)):
            if cache is not None:
                x = layer(x, cos, sin, cache)
            else:
                x = layer(x, cos, sin, attn_mask=starts if linear else mask, context_parallel=context_parallel)
        if incremental_state is not None:
            incremental_state["positions"] = start + T
        out = self.output(x, loss_target)
        return self._with_router_terms(out) if self.training else out

    def layer_attention_input(self, index: int, mask: Any, document_ids: Optional[torch.Tensor] = None) -> Any:
        """A linear layer's restarts of its state (the documents' starts, None without), a full layer's mask."""
        return document_starts(document_ids) if linear_layers(self.cfg)[index] else mask

    def _layer_caches(self, incremental_state: Optional[Dict]) -> List[Optional[Union[KVCache, RecurrentState]]]:
        """Decoding's state per layer: the recurrent state of a linear layer, the K/V cache of a full one."""
        if incremental_state is None:
            return [None] * len(self.layers)
        kinds = linear_layers(self.cfg)
        return incremental_state.setdefault("layers", [RecurrentState() if k else KVCache() for k in kinds])

    def initial_value(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """The MoE family's rules; the linear layers' own: A = exp(A_log) uniform in [1, 16], dt = softplus(a +
        dt_bias) log-uniform in [1e-3, 0.1] at a = 0 (Mamba 2's), the convolution as torch's default for its fan-in,
        the gated norm's scale 1 (not zero-centered), the projections in as the others, ``out_proj`` as a residual
        writer."""
        std = self.cfg.init_std
        if name.endswith("A_log"):
            return torch.empty(shape).uniform_(1.0, 16.0, generator=generator).log()
        if name.endswith("dt_bias"):
            dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(0.1), generator=generator).exp()
            return dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
        if name.endswith("conv1d.weight"):
            bound = 1.0 / math.sqrt(shape[-1])
            return torch.empty(shape).uniform_(-bound, bound, generator=generator)
        if name.endswith("self_attn.norm.weight"):
            return torch.ones(shape)
        if name.endswith(LINEAR_INPUTS):
            return torch.empty(shape).normal_(0.0, std, generator=generator)
        if name.endswith("out_proj.weight"):
            return torch.empty(shape).normal_(0.0, std / math.sqrt(2 * self.cfg.decoder_layers), generator=generator)
        return super().initial_value(name, shape, generator)

    def parameter_roles(self) -> Dict[str, str]:
        """The rotary decoder's roles; a linear layer's depthwise convolution kernels, decay rates (``A_log``) and
        ``dt_bias`` are per-channel constants, not matrices: ``bias`` (AdamW, no decay), never Muon's."""
        roles = super().parameter_roles()
        for name in roles:
            if name.endswith(("conv1d.weight", "A_log", "dt_bias")):
                roles[name] = "bias"
        return roles

    def flops_per_token(self, seq_len: int) -> int:
        """6N over the active matmul weights, plus the full layers' attention (12 H D T each) and the linear
        layers' state reads and writes (6 x 2 Hv Dk Dv each: no term in T)."""
        cfg = self.cfg
        kinds = linear_layers(cfg)
        full, linear = kinds.count(False), kinds.count(True)
        attention = 12 * full * cfg.decoder_attention_heads * head_dim(cfg) * seq_len
        state = 12 * linear * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        return int(6 * self.num_matmul_parameters() + attention + state)
