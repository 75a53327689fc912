"""The GLM-4.5 decoder (GLM-4.5, GLM-4.5-Air): the MoE family's model (``toolkit.models.moe``: the routers'
losses and loads beside the output, expert parallelism, the accounting of active parameters) with GLM's blocks:
pre-norm, grouped-query attention with q/k/v biases, optional per-head QK-norm and a partial rotary share of each
head (``common.attention.Attention``), a dense SwiGLU MLP in the first ``--first-k-dense-replace`` layers and
DeepSeekMoE in the others (the DeepSeek-V3 family's ``deepseek_moe``: sigmoid scores, group-limited top-k, the
correction bias, the routed scaling factor, shared experts).

Parameter names are Hugging Face's ``Glm4MoeForCausalLM`` ones inside a block, the experts stacked [E, ...] and
the correction bias the router's ``mlp.gate.expert_bias``, so ``hf.py`` renames and stacks only.

``--mtp-depth D`` adds D multi-token prediction depths (``common/mtp.py``) under ``mtp`` as DeepSeek-V3's: each a
MoE layer between its joining projection and its norm, trained only.
"""

from __future__ import annotations

from typing import Optional

from toolkit.core.registry import register_model
from toolkit.models.common.blocks import PreNormBlock
from toolkit.models.common.mtp import MultiTokenPrediction
from toolkit.models.common.rotary_decoder import decoder_attention
from toolkit.models.deepseek_v3.model import deepseek_moe
from toolkit.models.glm4_moe.config import Glm4MoeConfig, check_glm_shapes
from toolkit.models.glm4_moe.hf import Glm4MoeAdapter
from toolkit.models.glm4_moe.parallel import tensor_parallel_plan
from toolkit.models.moe.model import MoELanguageModel


@register_model("glm4_moe", dataclass=Glm4MoeConfig)
class Glm4MoeLanguageModel(MultiTokenPrediction, MoELanguageModel):
    """The GLM-4.5 decoder behind the toolkit's model interface: grouped-query attention with partial rotary, the
    first layers dense, DeepSeekMoE after them."""

    HF_ADAPTER = Glm4MoeAdapter
    PLAN = staticmethod(tensor_parallel_plan)

    @staticmethod
    def check_options(cfg: Glm4MoeConfig) -> None:
        check_glm_shapes(cfg)

    def build_block(self, cfg: Glm4MoeConfig, index: int, window: Optional[int]) -> PreNormBlock:
        mlp = self.gated_mlp() if index < cfg.first_k_dense_replace else deepseek_moe(cfg, index)
        return PreNormBlock(decoder_attention(cfg, window), mlp, norm=self.width_norm)
