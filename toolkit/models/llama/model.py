"""The Llama decoder: the block and the model, on the shared modules of ``toolkit.models.blocks``
(RMSNorm, rotary embeddings, the SwiGLU feed-forward) and the attention of ``toolkit.models.common.attention``.

Shape notation: B batch, T time, C = decoder_embed_dim, H query heads, G key/value heads
(H % G == 0), D head size (C // H unless --decoder-head-dim), F = decoder_ffn_embed_dim, V vocabulary.

Choices worth knowing
- Parameter names are Hugging Face's inside a block (``self_attn.q_proj``, ``mlp.gate_proj``,
  ``input_layernorm`` ...) and the toolkit's outside (``embed_tokens``, ``layers``, ``norm``,
  ``output_projection``, absent when tied), so checkpoints, the vocabulary-size check and the
  tensor-parallel plan read them the way they read ``transformer_lm``'s, and the Hugging Face
  adapters (``hf.py``) are a rename.
- Rotary embeddings use Hugging Face's convention (rotate the two halves of each head, not
  interleaved pairs), the layout its checkpoints are stored in. The cos/sin tables are
  computed buffers (not saved), recomputed by ``reset_buffers`` after ``to_empty``; the
  rotation runs in fp32 (bf16 angles lose positions beyond a few hundred).
- Each block takes the tables' rows of its positions as arguments, so a block is a plain
  ``(x, cos, sin[, cache])`` function that FSDP2, activation checkpointing and
  ``torch.compile`` wrap from outside, and incremental decoding continues the positions by
  slicing the tables further on.
- Attention is the attention package's ``Attention`` (``toolkit.models.common.attention``): SDPA,
  causal, with ``enable_gqa`` (no copy of the key/value heads); the KV cache holds G heads, not H.
  Qwen3's QK-norm (``--qk-norm``, an RMSNorm per head of q and k, parameters ``q_norm`` / ``k_norm``),
  Mistral's sliding window (``--sliding-window``; a local layer's cache keeps the last window - 1
  positions), Gemma's soft-cap and scale are its options; ``--layer-types`` makes only some layers local
  (Qwen2/Qwen3's ``max_window_layers``), the others global, each kind's mask built once per forward.
- Inputs are right-padded (fairseq's LM batches); attention is causal, so padding at the end
  of a row changes no earlier position. No dropout anywhere (none of the family uses it).
- Initial values come from ``initial_value(name, ...)`` seeded by (seed, name), as for
  ``transformer_lm`` (``toolkit.models.init``): N(0, init_std) everywhere, the two matrices
  that write into the residual stream (``o_proj``, ``down_proj``) at init_std / sqrt(2L),
  norms 1, biases 0.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.core.protocols import TensorParallelPlan
from toolkit.models.blocks.feed_forward import GatedFeedForward
from toolkit.models.blocks.norms import RMSNorm
from toolkit.models.common.attention import Attention, attention_mask
from toolkit.models.decoder import DecoderInterface, KVCache, roles_by_prefix
from toolkit.models.fused_loss import LossTarget
from toolkit.models.init import init_weights, meta_embedding
from toolkit.models.llama.config import LlamaConfig, check_shapes, head_dim, kv_heads, layer_windows
from toolkit.models.llama.hf import CLASSES as HF_CLASS_NAMES
from toolkit.models.llama.parallel import tensor_parallel_plan as family_plan
from toolkit.models.llama.rope import apply_rope, rope_frequencies, rope_tables  # noqa: F401  (their home before)
from toolkit.core.registry import register_model


class LlamaBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); with --norm-after-sublayer (OLMo 2)
    x + norm(attn(x)), then x + norm(mlp(x)); with --gemma-norms both, x + norm(attn(norm(x))), then
    x + norm(mlp(norm(x))). Hugging Face's names: ``input_layernorm``, ``post_attention_layernorm`` (Llama's is
    the MLP's input norm, OLMo 2's and Gemma's the attention's output norm), ``pre_feedforward_layernorm``,
    ``post_feedforward_layernorm``."""

    def __init__(self, cfg: LlamaConfig, window: Optional[int] = None):
        super().__init__()
        C, eps, gemma = cfg.decoder_embed_dim, cfg.rms_norm_eps, cfg.gemma_norms
        self.input_layernorm = None if cfg.norm_after_sublayer else RMSNorm(C, eps, unit_offset=gemma)
        self.self_attn = block_attention(cfg, window)
        self.post_attention_layernorm = RMSNorm(C, eps, unit_offset=gemma)
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(C, eps, unit_offset=True)
        self.mlp = GatedFeedForward(C, cfg.decoder_ffn_embed_dim, activation=cfg.mlp_activation)
        if cfg.norm_after_sublayer or gemma:
            self.post_feedforward_layernorm = RMSNorm(C, eps, unit_offset=gemma)
        self.gemma = gemma

    def attention_input(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.input_layernorm is None else self.input_layernorm(x)

    def add_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual add of the attention's output (normalized first after the sublayer), then the MLP's."""
        if self.gemma:
            x = x + self.post_attention_layernorm(attended)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.input_layernorm is None:
            x = x + self.post_attention_layernorm(attended)
            return x + self.post_feedforward_layernorm(self.mlp(x))
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: Optional[KVCache] = None,
        attn_mask: Any = None,
        context_parallel: Any = None,
    ) -> torch.Tensor:
        """``attn_mask``: the forward's mask for this layer's window; ``context_parallel``: the sequence shard
        (``toolkit.distributed.context_parallel.ContextShard``), whose ranks' keys the attention gathers."""
        h = self.attention_input(x)
        # The cache is passed only when there is one (the mask and the shard by keyword): styles hooked on
        # self_attn describe its positional inputs.
        if kv_cache is not None:
            return self.add_attention(x, self.self_attn(h, cos, sin, kv_cache))
        return self.add_attention(
            x, self.self_attn(h, cos, sin, attn_mask=attn_mask, context_parallel=context_parallel)
        )


def block_attention(cfg: LlamaConfig, window: Optional[int], qk_norm_over: Optional[str] = None) -> Attention:
    """A block's attention from the family's options (``qk_norm_over``: the config's unless given)."""
    eps = cfg.rms_norm_eps
    return Attention(
        cfg.decoder_embed_dim,
        cfg.decoder_attention_heads,
        kv_heads(cfg),
        head_dim(cfg),
        qkv_bias=cfg.attention_qkv_bias,
        qk_norm_eps=eps if cfg.qk_norm else None,
        window=window,
        qk_norm_per_head=(qk_norm_over or cfg.qk_norm_over) == "head",
        qk_norm_unit_offset=cfg.gemma_norms,
        softcap=cfg.attn_logit_softcap,
        scale=attention_scale(cfg),
    )


def attention_scale(cfg: LlamaConfig) -> Optional[float]:
    """1/sqrt(--query-pre-attn-scalar) (Gemma), else None: 1/sqrt(head size)."""
    return None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar**-0.5


@register_model("llama", dataclass=LlamaConfig)
class LlamaLanguageModel(DecoderInterface, nn.Module):
    """The decoder-only Llama / Mistral / Qwen2 / Qwen3 / OLMo 2 language model behind the toolkit's model interface."""

    supports_context_parallel = True  # its attention takes a ContextShard beside its inputs (forward's docstring)
    supports_fused_loss = True  # forward(..., loss_target=): output()

    def __init__(self, cfg: LlamaConfig, vocab_size: int, padding_idx: int, seed: Optional[int] = None):
        """Built on the meta device, parameters stay uninitialized (materialize, then ``init_weights``);
        otherwise they are set by ``init_weights(self, seed)`` (default ``torch.initial_seed()``)."""
        super().__init__()
        if cfg.max_target_positions is None:
            raise ValueError("max_target_positions must be set (build_model takes it from --tokens-per-sample)")
        check_shapes(cfg)
        self.cfg = cfg
        self.padding_idx = padding_idx
        self.max_target_positions = cfg.max_target_positions
        device = torch.empty(0).device  # the caller's default device (meta under `with torch.device("meta")`)
        with torch.device("meta"):
            self.embed_tokens = meta_embedding(vocab_size, cfg.decoder_embed_dim)
            self.layers = nn.ModuleList([LlamaBlock(cfg, window) for window in layer_windows(cfg)])
            self.norm = RMSNorm(cfg.decoder_embed_dim, cfg.rms_norm_eps, unit_offset=cfg.gemma_norms)
            self.output_projection = (
                None
                if cfg.share_decoder_input_output_embed
                else nn.Linear(cfg.decoder_embed_dim, vocab_size, bias=False)
            )
            self.register_buffer("rope_cos", torch.empty(cfg.max_target_positions, head_dim(cfg)), persistent=False)
            self.register_buffer("rope_sin", torch.empty(cfg.max_target_positions, head_dim(cfg)), persistent=False)
            if cfg.rope_local_theta is not None:  # Gemma 3: the local layers rotate with their own base
                self.register_buffer(
                    "rope_local_cos", torch.empty(cfg.max_target_positions, head_dim(cfg)), persistent=False
                )
                self.register_buffer(
                    "rope_local_sin", torch.empty(cfg.max_target_positions, head_dim(cfg)), persistent=False
                )
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
    ) -> Any:
        """tokens: LongTensor [B, T] (right-padded) -> logits [B, T, V].

        ``loss_target`` (the criterion's): the summed NLL of those targets instead of the logits, the head and
        the loss fused (``DecoderInterface.fused_head_loss``), except under Gemma 2's logit soft-cap.

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
        """The token embeddings, times sqrt(width) with --gemma-norms (in the weights' dtype, as Gemma)."""
        x = self.embed_tokens(tokens)
        if self.cfg.gemma_norms:
            x = x * torch.tensor(self.cfg.decoder_embed_dim**0.5, dtype=x.dtype)
        return x

    def rope_rows(self, window: Optional[int], start: int, T: int, positions: Optional[torch.Tensor] = None):
        """cos, sin of positions start..start+T-1 (or ``positions`` [B, T]: [B, 1, T, D]) for a layer of
        ``window``: the local tables for a local layer when --rope-local-theta is given."""
        local = window is not None and self.cfg.rope_local_theta is not None
        cos, sin = (self.rope_local_cos, self.rope_local_sin) if local else (self.rope_cos, self.rope_sin)
        if positions is None:
            return cos[start : start + T], sin[start : start + T]
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # per row, broadcast over the heads

    def output(self, x: torch.Tensor, loss_target: Optional[LossTarget] = None) -> Any:
        """Final norm, output layer (the embedding when tied), Gemma 2's soft-cap of the logits; with
        ``loss_target`` the fused head and loss where it applies (no soft-cap: the fused softmax reads raw logits)."""
        x = self.norm(x)
        if loss_target is not None and self.cfg.final_logit_softcap is None:
            weight = self.embed_tokens.weight if self.output_projection is None else self.output_projection.weight
            fused = self.fused_head_loss(x, weight, loss_target)
            if fused is not None:
                return fused
        logits = F.linear(x, self.embed_tokens.weight) if self.output_projection is None else self.output_projection(x)
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def get_normalized_probs(self, net_output, log_probs: bool = True) -> torch.Tensor:
        """fp32 [B, T, V] (log-)probabilities of the next token, from ``forward``'s output."""
        x = net_output[0] if isinstance(net_output, (tuple, list)) else net_output
        return F.log_softmax(x.float(), dim=-1) if log_probs else F.softmax(x.float(), dim=-1)

    # ---- initialization (driven by toolkit.models.init.init_weights) ----

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the rotary tables (after ``to_empty``; init_weights calls this)."""
        cos, sin = rope_tables(self.cfg, self.rope_cos.size(0), device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        if self.cfg.rope_local_theta is not None:
            cos, sin = rope_tables(self.cfg, self.rope_cos.size(0), device=self.rope_cos.device, local=True)
            self.rope_local_cos.copy_(cos)
            self.rope_local_sin.copy_(sin)

    def initial_value(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """The full initial fp32 value of parameter ``name`` (see the module docstring), drawn from ``generator``."""
        if name.endswith(".bias"):
            return torch.zeros(shape)
        if name.endswith("norm.weight"):  # the identity: Gemma's scale is 1 + weight
            return torch.zeros(shape) if self.cfg.gemma_norms else torch.ones(shape)
        std = self.cfg.init_std
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std = std / math.sqrt(2 * self.cfg.decoder_layers)
        elif not name.endswith(
            (
                "embed_tokens.weight",
                "output_projection.weight",
                "q_proj.weight",
                "k_proj.weight",
                "v_proj.weight",
                "gate_proj.weight",
                "up_proj.weight",
            )
        ):
            raise KeyError(f"no initialization rule for parameter {name}")
        return torch.empty(shape).normal_(0.0, std, generator=generator)

    no_decay_norms_biases_embeddings_by_default = True  # the usual rule of 2024-26 pretraining recipes

    def parameter_roles(self) -> Dict[str, str]:
        """What each parameter is to the optimizer (``toolkit.core.protocols.ParameterRoles``): Muon's matrices are
        the blocks' projections; the token table and the untied head go to AdamW."""
        return roles_by_prefix(self, embeddings=("embed_tokens.",), outputs=("output_projection.",))

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        """torchtitan's split of this model's modules (``parallel.py``), for ``--model-parallel-size``."""
        return family_plan(self)

    # ---- export (imported when asked: hf.py maps configs and names, hf_files.py the folders, cached.py ONNX) ----

    HF_CLASSES = HF_CLASS_NAMES  # --from hf reads these config.json model_types

    @classmethod
    def from_hf(cls, folder: str, config: Dict[str, Any], out_dir: str, tokens_per_sample: Optional[int], advance):
        """``--from hf``: a Llama, Mistral, Qwen2 or Qwen3 folder as our checkpoint (``hf_files.py``)."""
        from toolkit.models.llama.hf_files import read_llama

        return read_llama(folder, config, out_dir, tokens_per_sample, advance)

    def hf_weights(self, hf_class: str, dictionary, first_symbol: int, data_dir: str):
        """``--format hf``: the class it was imported from (else the class its options need), see ``hf_files.py``."""
        from toolkit.models.llama.hf_files import hf_weights

        return hf_weights(self, hf_class, dictionary, first_symbol, data_dir)

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
