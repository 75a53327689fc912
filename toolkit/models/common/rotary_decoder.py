"""The decoder-only language model the rotary families share (``llama``, ``gemma3``, ``olmo2``, ``moe``): token
embedding, a stack of blocks, a final norm and the output layer, rotary tables as computed buffers.

A family is a subclass that says how its block is composed (``build_block``: which placement of
``common/blocks.py``, which attention (``decoder_attention``: the one call that builds a block's attention),
which MLP) and, where it differs, its final norm, the embedding scale, the logits' soft-cap and the local layers'
rotary base; its ``PLAN`` (``parallel.py``) and ``HF_ADAPTER`` (``hf.py``). Everything else is here once.

Shape notation: B batch, T time, C = decoder_embed_dim, H query heads, G key/value heads
(H % G == 0), D head size (C // H unless --decoder-head-dim), F = decoder_ffn_embed_dim, V vocabulary.

Choices worth knowing
- Parameter names are Hugging Face's inside a block (``self_attn.q_proj``, ``mlp.gate_proj``,
  ``input_layernorm`` ...) and the toolkit's outside (``embed_tokens``, ``layers``, ``norm``,
  ``output_projection``, absent when tied), so checkpoints, the vocabulary-size check and the
  tensor-parallel plan read them the way they read ``transformer_lm``'s, and a family's Hugging Face
  adapter (its ``hf.py``) is a rename.
- Rotary embeddings use Hugging Face's convention (rotate the two halves of the rotated features, not
  interleaved pairs), the layout its checkpoints are stored in. The cos/sin tables are computed buffers
  (not saved), recomputed by ``reset_buffers`` after ``to_empty``; the rotation runs in fp32 (bf16 angles
  lose positions beyond a few hundred). ``rope_table`` is the one place that says which tables a layer
  rotates with (a local layer's own base where the family has one).
- Each block takes the tables' rows of its positions as arguments, so incremental decoding continues the
  positions by slicing the tables further on.
- The KV cache holds G heads, not H. Local layers (``--sliding-window``, ``--layer-types``) and global
  ones each get their mask built once per forward.
- Inputs are right-padded (fairseq's LM batches); attention is causal, so padding at the end
  of a row changes no earlier position. No dropout anywhere (none of these families uses it).
- Initial values come from ``initial_value(name, ...)`` seeded by (seed, name), as for
  ``transformer_lm`` (``toolkit.models.init``): N(0, init_std) everywhere, the two matrices
  that write into the residual stream (``o_proj``, ``down_proj``) at init_std / sqrt(2L),
  norms the identity (weight 1, or 0 where the scale is ``1 + weight``), biases 0.
"""

from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.core.protocols import TensorParallelPlan
from toolkit.models.common.attention import Attention, attention_mask
from toolkit.models.common.blocks import DecoderBlock
from toolkit.models.common.hf_adapter import HFConvertible
from toolkit.models.common.mlp import GatedFeedForward
from toolkit.models.common.norms import RMSNorm
from toolkit.models.common.options import (
    DecoderOptions,
    check_shapes,
    head_dim,
    kv_heads,
    layer_windows,
    rotary_dim,
)
from toolkit.models.common.rope import decoder_tables
from toolkit.models.decoder import DecoderInterface, roles_by_prefix
from toolkit.models.fused_loss import LossTarget
from toolkit.models.init import init_weights, meta_embedding

LINEAR_WEIGHTS = (
    "embed_tokens.weight",
    "output_projection.weight",
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
)
RESIDUAL_WRITERS = ("o_proj.weight", "down_proj.weight")  # initialized at init_std / sqrt(2L)


def decoder_attention(cfg: DecoderOptions, window: Optional[int], **variant: Any) -> Attention:
    """A block's attention of ``cfg`` (``toolkit.models.common.attention``): grouped-query heads, q/k/v biases and
    per-head QK-norm as the options say, ``window`` the layer's; ``variant`` the family's own (score scale, soft-cap,
    QK-norm over the projections or scaling by (1 + w))."""
    return Attention(
        cfg.decoder_embed_dim,
        cfg.decoder_attention_heads,
        kv_heads(cfg),
        head_dim(cfg),
        qkv_bias=cfg.attention_qkv_bias,
        qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None,
        window=window,
        **variant,
    )


class RotaryDecoderLM(HFConvertible, DecoderInterface, nn.Module):
    """The model of a rotary decoder family; a family subclasses it (see the module docstring)."""

    supports_context_parallel = True  # its attention takes a ContextShard beside its inputs (forward's docstring)
    supports_fused_loss = True  # forward(..., loss_target=): output()
    no_decay_norms_biases_embeddings_by_default = True  # the usual rule of 2024-26 pretraining recipes
    unit_offset_norms: ClassVar[bool] = False  # RMSNorm scales are 1 + weight (Gemma): initialized to 0
    PLAN: ClassVar[Callable[[nn.Module], TensorParallelPlan]]  # the family's parallel.tensor_parallel_plan

    def __init__(self, cfg: DecoderOptions, vocab_size: int, padding_idx: int, seed: Optional[int] = None):
        """Built on the meta device, parameters stay uninitialized (materialize, then ``init_weights``);
        otherwise they are set by ``init_weights(self, seed)`` (default ``torch.initial_seed()``)."""
        super().__init__()
        if cfg.max_target_positions is None:
            raise ValueError("max_target_positions must be set (build_model takes it from --tokens-per-sample)")
        self.check_options(cfg)
        self.cfg = cfg
        self.padding_idx = padding_idx
        self.max_target_positions = cfg.max_target_positions
        device = torch.empty(0).device  # the caller's default device (meta under `with torch.device("meta")`)
        with torch.device("meta"):
            self.embed_tokens = meta_embedding(vocab_size, cfg.decoder_embed_dim)
            self.layers = nn.ModuleList(
                [self.build_block(cfg, i, window) for i, window in enumerate(layer_windows(cfg))]
            )
            self.norm = self.build_norm(cfg.decoder_embed_dim)
            self.build_extra_modules(cfg)
            self.output_projection = (
                None
                if cfg.share_decoder_input_output_embed
                else nn.Linear(cfg.decoder_embed_dim, vocab_size, bias=False)
            )
            width = rotary_dim(cfg)
            self.register_buffer("rope_cos", torch.empty(cfg.max_target_positions, width), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.max_target_positions, width), persistent=False)
            if self.local_rope_theta(cfg) is not None:  # the local layers rotate with their own base
                self.register_buffer("rope_local_cos", torch.empty(cfg.max_target_positions, width), persistent=False)
                self.register_buffer("rope_local_sin", torch.empty(cfg.max_target_positions, width), persistent=False)
        if device.type != "meta":
            self.to_empty(device=device)
            init_weights(self, torch.initial_seed() if seed is None else seed)

    # ---- what a family says ----

    @staticmethod
    def check_options(cfg: DecoderOptions) -> None:
        """One line per impossible setting, before anything is built."""
        check_shapes(cfg)

    def build_block(self, cfg: DecoderOptions, index: int, window: Optional[int]) -> DecoderBlock:
        """Layer ``index``: its placement of norms around an attention (of ``window``) and an MLP."""
        raise NotImplementedError

    def build_extra_modules(self, cfg: DecoderOptions) -> None:
        """Modules a family adds beside the blocks (multi-token prediction depths), built on the meta device and
        initialized with the others; none by default."""

    def layer_attention_input(self, index: int, mask: Any, document_ids: Optional[torch.Tensor] = None) -> Any:
        """What layer ``index``'s token mixer takes as ``attn_mask``, given the mask of its window and the rows'
        ``document_ids`` (None without, and under context parallelism, whose shard holds them): the mask, where
        every layer attends. A pipeline stage, which runs the layers by their whole-model indices, asks it."""
        return mask

    def build_norm(self, dim: int) -> nn.Module:
        """The family's RMSNorm over ``dim`` features (the blocks', the final one)."""
        return RMSNorm(dim, self.cfg.rms_norm_eps, unit_offset=self.unit_offset_norms)

    def width_norm(self) -> nn.Module:
        """A norm over the model's width: what a block's placements take (``norm=self.width_norm``)."""
        return self.build_norm(self.cfg.decoder_embed_dim)

    def gated_mlp(self) -> GatedFeedForward:
        """The gated MLP of the options (SwiGLU or GeGLU, ``--mlp-activation``)."""
        cfg = self.cfg
        return GatedFeedForward(cfg.decoder_embed_dim, cfg.decoder_ffn_embed_dim, activation=cfg.mlp_activation)

    @staticmethod
    def local_rope_theta(cfg: DecoderOptions) -> Optional[float]:
        """The rotary base of the local layers when it is their own (Gemma 3), else None."""
        return None

    def embed_scale(self) -> Optional[float]:
        """What the token embeddings are multiplied by (Gemma: sqrt(width)), None for nothing."""
        return None

    def logit_softcap(self) -> Optional[float]:
        """cap of cap * tanh(logits / cap) on the output (Gemma 2), None for none."""
        return None

    # ---- the forward ----

    def forward(
        self,
        tokens: torch.Tensor,
        incremental_state: Optional[Dict] = None,
        document_ids: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        context_parallel: Any = None,
        loss_target: Optional[LossTarget] = None,
    ) -> Any:
        """tokens: LongTensor [B, T] (right-padded) -> logits [B, T, V].

        ``loss_target`` (the criterion's): the summed NLL of those targets instead of the logits, the head and
        the loss fused (``DecoderInterface.fused_head_loss``), except under a logit soft-cap.

        ``document_ids`` [B, T]: attention stays inside each document; ``positions`` [B, T]: each
        token's rotary position (restarting per document) (``toolkit.models.document_mask``).
        ``context_parallel``: this rank's chunks of the sequences (``--context-parallel-size``): ``tokens`` and
        ``positions`` are the chunks', and every layer's attention gathers the keys/values of the whole sequence
        through the shard (``toolkit.distributed.context_parallel``).

        With ``incremental_state`` (a dict, empty at the first call, then owned by the model:
        ``"positions"`` cached so far and one ``KVCache`` per layer under ``"layers"``),
        ``tokens`` are only the new tokens and their rotary positions continue after the cached ones.
        """
        start, T = self._first_position(tokens, incremental_state), tokens.size(1)
        x = self.embed(tokens)
        windows = layer_windows(self.cfg)  # local and global layers attend differently: one mask per kind
        tables = {window: self.rope_rows(window, start, T, positions) for window in set(windows)}
        if context_parallel is None:
            masks = {
                window: attention_mask(document_ids, T, tokens.device, window=window, head_dim=head_dim(self.cfg))
                for window in set(windows)
            }
        else:  # each layer sees the keys of the ranks through the shard's layout, not through a mask
            masks = dict.fromkeys(windows)
        for layer, window, cache in zip(self.layers, windows, self._layer_caches(incremental_state)):
            mask, (cos, sin) = masks[window], tables[window]
            if cache is not None:
                x = layer(x, cos, sin, cache)
            else:
                x = layer(x, cos, sin, attn_mask=mask, context_parallel=context_parallel)
        if incremental_state is not None:
            incremental_state["positions"] = start + T
        return self.output(x, loss_target)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The token embeddings, times the family's scale where it has one (in the weights' dtype, as Gemma)."""
        x = self.embed_tokens(tokens)
        scale = self.embed_scale()
        if scale is not None:
            x = x * torch.tensor(scale, dtype=x.dtype)
        return x

    def rope_table(self, window: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """The whole cos, sin tables [max_target_positions, R] a layer of ``window`` rotates with: the local
        ones for a local layer where the family gives local layers their own base, else the global ones."""
        if window is not None and self.local_rope_theta(self.cfg) is not None:
            return self.rope_local_cos, self.rope_local_sin
        return self.rope_cos, self.rope_sin

    def rope_rows(self, window: Optional[int], start: int, T: int, positions: Optional[torch.Tensor] = None):
        """cos, sin of positions start..start+T-1 (or ``positions`` [B, T]: [B, 1, T, R]) for a layer of ``window``."""
        cos, sin = self.rope_table(window)
        if positions is None:
            return cos[start : start + T], sin[start : start + T]
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # per row, broadcast over the heads

    def output(self, x: torch.Tensor, loss_target: Optional[LossTarget] = None) -> Any:
        """Final norm, output layer (the embedding when tied), the logits' soft-cap; with ``loss_target`` the
        fused head and loss where it applies (no soft-cap: the fused softmax reads raw logits)."""
        x = self.norm(x)
        cap = self.logit_softcap()
        if loss_target is not None and cap is None:
            weight = self.embed_tokens.weight if self.output_projection is None else self.output_projection.weight
            fused = self.fused_head_loss(x, weight, loss_target)
            if fused is not None:
                return fused
        logits = F.linear(x, self.embed_tokens.weight) if self.output_projection is None else self.output_projection(x)
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def get_normalized_probs(self, net_output, log_probs: bool = True) -> torch.Tensor:
        """fp32 [B, T, V] (log-)probabilities of the next token, from ``forward``'s output."""
        x = net_output[0] if isinstance(net_output, (tuple, list)) else net_output
        return F.log_softmax(x.float(), dim=-1) if log_probs else F.softmax(x.float(), dim=-1)

    # ---- initialization (driven by toolkit.models.init.init_weights) ----

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the rotary tables (after ``to_empty``; init_weights calls this)."""
        positions, device = self.rope_cos.size(0), self.rope_cos.device
        cos, sin = decoder_tables(self.cfg, positions, device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        theta = self.local_rope_theta(self.cfg)
        if theta is not None:
            cos, sin = decoder_tables(self.cfg, positions, device, local_theta=theta)
            self.rope_local_cos.copy_(cos)
            self.rope_local_sin.copy_(sin)

    def initial_value(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """The full initial fp32 value of parameter ``name`` (see the module docstring), drawn from ``generator``."""
        if name.endswith(".bias"):
            return torch.zeros(shape)
        if name.endswith("norm.weight"):  # the identity scale
            return torch.zeros(shape) if self.unit_offset_norms else torch.ones(shape)
        std = self.cfg.init_std
        if name.endswith(RESIDUAL_WRITERS):
            std = std / math.sqrt(2 * self.cfg.decoder_layers)
        elif not name.endswith(LINEAR_WEIGHTS):
            raise KeyError(f"no initialization rule for parameter {name}")
        return torch.empty(shape).normal_(0.0, std, generator=generator)

    def parameter_roles(self) -> Dict[str, str]:
        """What each parameter is to the optimizer (``toolkit.core.protocols.ParameterRoles``): Muon's matrices are
        the blocks' projections; the token table and the untied head go to AdamW."""
        return roles_by_prefix(self, embeddings=("embed_tokens.",), outputs=("output_projection.",))

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        """torchtitan's split of this model's modules (the family's ``parallel.py``), for ``--model-parallel-size``."""
        return type(self).PLAN(self)

    # ---- export: the family's Hugging Face adapter (its hf.py, ``HFConvertible``), the ONNX cached forward ----

    def onnx_cached_decoder(self) -> nn.Module:
        """``--format onnx --kv-cache``: the forward after P cached positions, G key/value heads (``cached.py``)."""
        from toolkit.models.llama.cached import LlamaCachedDecoder

        return LlamaCachedDecoder(self)

    # ---- accounting ----

    def num_matmul_parameters(self) -> int:
        """Weights used in matmuls per token (the N of 6N): all but the embedding lookup, plus the
        output layer (the embedding itself when tied). Norm weights count, as in transformer_lm."""
        params = {id(p): p for p in self.parameters()}.values()
        total = sum(p.numel() for p in params)
        embed = self.embed_tokens.weight.numel()
        return total if self.output_projection is None else total - embed

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, PaLM appendix B: 6N + 12·L·H·D·T (attention's QK^T and AV over the
        query heads, forward and backward, not halved for the causal mask)."""
        attention = 12 * self.cfg.decoder_layers * self.cfg.decoder_attention_heads * head_dim(self.cfg) * seq_len
        return int(6 * self.num_matmul_parameters() + attention)
