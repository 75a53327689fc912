"""The mixture-of-experts decoder: Llama's blocks with a ``MoE`` feed-forward (``toolkit.models.blocks.moe``).

Parameter names are Hugging Face's Qwen3-MoE / OLMoE ones (``layers.i.mlp.gate.weight`` the router,
``layers.i.mlp.experts.{gate,up,down}_proj`` the experts stacked [E, ...]), so ``hf.py`` only stacks and
unstacks the per-expert tensors. In training the forward returns ``(logits, extra)`` (``toolkit.models.outputs``):
the load-balancing and router z-losses, each the mean over the layers with its ``--moe-*-coef``, and per layer
the busiest expert's load over the mean (``moe_max_load_<layer>``), plus the tokens dropped (``moe_dropped``,
0: dispatch is dropless). In evaluation it returns the logits alone, as the Llama model.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn

from toolkit.core.protocols import TensorParallelPlan
from toolkit.core.registry import register_model
from toolkit.models.blocks.moe import MoE
from toolkit.models.init import init_weights
from toolkit.models.llama.config import layer_windows
from toolkit.models.llama.model import LlamaBlock, LlamaLanguageModel, block_attention
from toolkit.models.moe.config import MoEConfig, check_moe_shapes
from toolkit.models.moe.hf import CLASSES as HF_CLASS_NAMES
from toolkit.models.moe.parallel import tensor_parallel_plan as family_plan
from toolkit.models.fused_loss import LossTarget
from toolkit.models.outputs import SUMMED_NLL, summed_nll_of, with_extras

EXPERT_WEIGHTS = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")


class MoEBlock(LlamaBlock):
    """Llama's pre-norm block, its MLP a mixture of experts."""

    def __init__(self, cfg: MoEConfig, index: int):
        super().__init__(cfg, layer_windows(cfg)[index])
        C = cfg.decoder_embed_dim
        if cfg.qk_norm and cfg.qk_norm_full_width:  # OLMoE: one RMSNorm over the whole q (k) projection
            self.self_attn = block_attention(cfg, self.self_attn.window, qk_norm_over="projection")
        self.mlp = MoE(
            C,
            cfg.moe_ffn_embed_dim,
            num_experts=cfg.moe_num_experts,
            top_k=cfg.moe_top_k,
            score_func=cfg.moe_score_func,
            renormalize=cfg.moe_renormalize,
            shared_hidden=cfg.moe_shared_ffn_embed_dim,
            bias_update_rate=cfg.moe_bias_update_rate,
            idle_warning_updates=cfg.moe_idle_warning_updates,
            name=f"layers.{index}.mlp",
        )


@register_model("moe", dataclass=MoEConfig)
class MoELanguageModel(LlamaLanguageModel):
    """Qwen3-MoE / OLMoE / Mixtral-style sparse decoder behind the toolkit's model interface."""

    supports_expert_parallel = True  # the experts of each layer are spread by toolkit.distributed.expert_parallel

    def __init__(self, cfg: MoEConfig, vocab_size: int, padding_idx: int, seed: Optional[int] = None):
        check_moe_shapes(cfg)
        device = torch.empty(0).device
        with torch.device("meta"):  # the Llama model's parts on the meta device, then the MoE blocks
            super().__init__(cfg, vocab_size, padding_idx)
            self.layers = nn.ModuleList([MoEBlock(cfg, i) for i in range(cfg.decoder_layers)])
        if device.type != "meta":
            self.to_empty(device=device)
            init_weights(self, torch.initial_seed() if seed is None else seed)

    def forward(
        self,
        tokens: torch.Tensor,
        incremental_state: Optional[Dict] = None,
        document_ids: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        context_parallel: Any = None,
        loss_target: Optional[LossTarget] = None,
    ):
        """Llama's forward (``context_parallel``: this rank's chunks of the sequences); in training the routers' terms
        beside the output, their statistics taken over the whole sequences (every cp rank's tokens)."""
        for moe in self.moe_layers():
            moe.context_group = None if context_parallel is None else context_parallel.group
        out = super().forward(tokens, incremental_state, document_ids, positions, context_parallel, loss_target)
        if not self.training:
            return out
        return self._with_router_terms(out)

    def moe_layers(self) -> List[MoE]:
        """The MoE modules in layer order (found through any wrapper: FSDP2, checkpointing, compile)."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def _with_router_terms(self, out: Any):
        """``out`` (logits, or the fused head's ``(None, {"summed_nll": ...})``) with the routers' terms added."""
        layers = [m for m in self.moe_layers() if m.aux]
        if not layers:
            return out
        summed_nll = summed_nll_of(out)
        logits, kept = (None, {SUMMED_NLL: summed_nll}) if summed_nll is not None else (out, {})
        L = len(layers)
        aux = {
            "moe_aux_loss": (sum(m.aux["balance"] for m in layers) / L, self.cfg.moe_aux_loss_coef),
            "moe_z_loss": (sum(m.aux["z"] for m in layers) / L, self.cfg.moe_z_loss_coef),
        }
        metrics = {f"moe_max_load_{i}": m.load["max_load"] for i, m in enumerate(layers)}
        metrics["moe_dropped"] = sum(m.load["dropped"] for m in layers)
        for m in layers:
            m.aux, m.load = {}, {}
        return with_extras(logits, aux, metrics, **kept)

    def initial_value(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """Llama's rules; stacked experts as their Linear counterparts (down_proj scaled by 1/sqrt(2 x layers)),
        the router as a projection."""
        if name.endswith(EXPERT_WEIGHTS) or name.endswith("mlp.gate.weight"):
            std = self.cfg.init_std
            if name.endswith("down_proj"):
                std = std / math.sqrt(2 * self.cfg.decoder_layers)
            return torch.empty(shape).normal_(0.0, std, generator=generator)
        return super().initial_value(name, shape, generator)

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        """Llama's attention split; the experts in the plan's expert slot (``parallel.py``)."""
        return family_plan(self)

    # ---- export (hf.py maps configs and names; the folders are read and written by the Llama family's code) ----

    HF_CLASSES = HF_CLASS_NAMES

    @classmethod
    def from_hf(cls, folder: str, config, out_dir: str, tokens_per_sample: Optional[int], advance):
        """``--from hf``: a Qwen3-MoE, OLMoE or Mixtral folder as our checkpoint (``hf.py``)."""
        from toolkit.models.llama.hf_files import read_llama
        import toolkit.models.moe.hf as adapter

        return read_llama(folder, config, out_dir, tokens_per_sample, advance, adapter=adapter)

    def hf_weights(self, hf_class: str, dictionary, first_symbol: int, data_dir: str):
        """``--format hf``: the class it was imported from (else Qwen3-MoE), per-expert tensors (``hf.py``)."""
        from toolkit.models.llama.hf_files import hf_weights
        import toolkit.models.moe.hf as adapter

        return hf_weights(self, hf_class, dictionary, first_symbol, data_dir, adapter=adapter)

    # ---- accounting: a token uses k of the E experts ----

    def expert_parameters(self) -> int:
        return sum(p.numel() for name, p in self.named_parameters() if name.endswith(EXPERT_WEIGHTS))

    def active_parameters(self) -> int:
        """Parameters one token uses: all but the (E - k) / E of the experts it is not routed to (the
        embedding counted, as in the published "active" figures)."""
        idle = self.expert_parameters() * (self.cfg.moe_num_experts - self.cfg.moe_top_k) // self.cfg.moe_num_experts
        return sum(p.numel() for p in self.parameters()) - idle

    def num_matmul_parameters(self) -> int:
        """The N of 6N over the *active* experts: Llama's count less the experts a token is not routed to."""
        idle = self.expert_parameters() * (self.cfg.moe_num_experts - self.cfg.moe_top_k) // self.cfg.moe_num_experts
        return super().num_matmul_parameters() - idle
