"""A decoder-only Transformer language model, fairseq's ``transformer_lm``.

Read top to bottom: the attention and block modules, the model, its initialization rule and
FLOPs (the options are ``config.py``, the named sizes ``archs.py``, the tensor-parallel plan
``parallel.py``).

Shape notation: B batch, T time (tokens), C = decoder_embed_dim, H heads,
D = C // H head size, V vocabulary.

Choices worth knowing
- Pre-norm (``decoder_normalize_before``): fairseq's ``base_lm_architecture`` forces it on
  for every *named* ``transformer_lm`` arch ("training is not stable without this"). Plain
  ``--arch transformer_lm`` is fairseq's config defaults (fairseq >= 0.11): the post-norm
  block, and 512-wide input/output embeddings; ``--decoder-normalize-before`` and
  ``--decoder-input-dim``/``--decoder-output-dim`` change that, as in fairseq.
- Inputs are right-padded (fairseq's LM batches). Attention is causal, so the
  padding at the end of a row cannot change any earlier position and no padding
  mask is needed; the outputs at padded positions are ignored by the loss.
- Positions. fairseq numbers non-pad tokens ``padding_idx + 1, padding_idx + 2, ...``
  and gives pad tokens the (zero) row ``padding_idx``. We number every position
  ``padding_idx + 1 + t``, which is the same for every real token of a
  right-padded row, and lets us look up one [T, C] block for the whole batch.
  The learned table keeps fairseq's size (``max_target_positions + padding_idx + 1``
  rows) so parameter counts and checkpoints line up with fairseq's.
- Parameters are not randomized by module constructors in any order-dependent
  way: every value comes from ``initial_value(name, ...)`` with a generator
  seeded by (seed, name) (see ``toolkit.models.init``), so a model built on the
  meta device, sharded, and materialized gets exactly the values of a plain build.
- Embedding and output layer. Tokens are embedded by a [V, C_in] table, or by an adaptive
  input (``--adaptive-input``: per-band tables and projections, ``toolkit.models.adaptive``);
  ``project_in_dim`` / ``project_out_dim`` map C_in -> C and C -> C_out when they differ. The
  output layer is a [V, C_out] projection (the embedding itself with
  ``--share-decoder-input-output-embed``), or an adaptive softmax (``--adaptive-softmax-cutoff``):
  then ``forward`` returns the features, which ``get_normalized_probs`` scores as fairseq's decoder does, or,
  given the ``adaptive_loss`` criterion's ``loss_target``, the summed loss of its targets.
- No parallelism code lives here; ``self.layers`` is a ModuleList of blocks so
  FSDP2 / activation checkpointing can be applied per block from outside, and
  tensor parallelism (``toolkit.distributed.tensor_parallel``, by the plan of ``parallel.py``)
  shards the linear layers from outside too: attention takes its head count from qkv_proj's output width.
- Incremental decoding (generation): ``forward(tokens, incremental_state)`` takes only
  the new tokens; each layer keeps the keys and values of the positions already seen
  in a ``KVCache``, so a new token costs one position, not the whole prefix.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.core.protocols import TensorParallelPlan
from toolkit.core.errors import UserError
from toolkit.models import adaptive
from toolkit.models.adaptive import AdaptiveInput, AdaptiveSoftmax
from toolkit.models.common.attention import FusedQKVAttention, attention_mask
from toolkit.models.common.hf_adapter import HFConvertible
from toolkit.models.common.mlp import ACTIVATIONS
from toolkit.models.decoder import DecoderInterface, KVCache, roles_by_prefix
from toolkit.models.fused_loss import LossTarget
from toolkit.models.init import init_weights, meta_embedding
from toolkit.models import quant_noise
from toolkit.models.layerdrop import LayerDrop, parse_layers_to_keep, prune_state_dict
from toolkit.models.outputs import with_summed_nll
from toolkit.models.transformer_lm.config import ACTIVATION_NAMES, TransformerLMConfig
from toolkit.models.transformer_lm.hf import TransformerLMAdapter
from toolkit.models.transformer_lm.parallel import tensor_parallel_plan as family_plan
from toolkit.core.registry import register_model

assert set(ACTIVATION_NAMES) <= set(ACTIVATIONS)  # the --activation-fn choices (config.py) name the one table


class CausalSelfAttention(FusedQKVAttention):
    """fairseq's self-attention of the decoder (``qkv_proj``, ``out_proj``; ``toolkit.models.common.attention``)."""

    def __init__(self, cfg: TransformerLMConfig):
        C, H = cfg.decoder_embed_dim, cfg.decoder_attention_heads
        if C % H != 0:
            raise ValueError(f"--decoder-embed-dim ({C}) must be divisible by --decoder-attention-heads ({H})")
        super().__init__(C, H, dropout=cfg.attention_dropout)


class TransformerBlock(nn.Module):
    """One decoder layer: self-attention then feed-forward, each with a residual connection."""

    def __init__(self, cfg: TransformerLMConfig):
        super().__init__()
        C = cfg.decoder_embed_dim
        self.normalize_before = cfg.decoder_normalize_before
        self.dropout = cfg.dropout
        self.activation_dropout = cfg.activation_dropout or cfg.relu_dropout  # fairseq's fallback
        self.activation = ACTIVATIONS[cfg.activation_fn]
        self.self_attn_layer_norm = nn.LayerNorm(C)
        self.self_attn = CausalSelfAttention(cfg)
        self.final_layer_norm = nn.LayerNorm(C)  # fairseq's name for the FFN's LayerNorm
        self.fc1 = nn.Linear(C, cfg.decoder_ffn_embed_dim)
        self.fc2 = nn.Linear(cfg.decoder_ffn_embed_dim, C)

    def _dropout(self, x: torch.Tensor, p: float) -> torch.Tensor:
        return F.dropout(x, p, training=True) if p > 0 and self.training else x

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self._dropout(self.activation(self.fc1(x)), self.activation_dropout))

    def attention(self, x: torch.Tensor, kv_cache: Optional[KVCache], attn_mask: Any = None) -> torch.Tensor:
        # The cache (or a document mask, by keyword) is passed only when there is one: parallel styles
        # hooked on self_attn (tensor parallelism) describe its one positional input.
        if kv_cache is not None:
            return self.self_attn(x, kv_cache)
        return self.self_attn(x) if attn_mask is None else self.self_attn(x, attn_mask=attn_mask)

    def forward(self, x: torch.Tensor, kv_cache: Optional[KVCache] = None, attn_mask: Any = None) -> torch.Tensor:
        if self.normalize_before:  # pre-norm: x + f(LN(x))
            x = x + self._dropout(self.attention(self.self_attn_layer_norm(x), kv_cache, attn_mask), self.dropout)
            x = x + self._dropout(self.ffn(self.final_layer_norm(x)), self.dropout)
        else:  # post-norm: LN(x + f(x))
            x = self.self_attn_layer_norm(x + self._dropout(self.attention(x, kv_cache, attn_mask), self.dropout))
            x = self.final_layer_norm(x + self._dropout(self.ffn(x), self.dropout))
        return x


def sinusoidal_table(num_positions: int, dim: int, first_position: int, device=None) -> torch.Tensor:
    """fairseq's sinusoidal embeddings ([sin | cos] halves) for positions first_position, first_position+1, ..."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float32, device=device) * -(math.log(10000.0) / max(half - 1, 1)))
    pos = torch.arange(first_position, first_position + num_positions, dtype=torch.float32, device=device)
    angles = pos[:, None] * freq[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2 == 1:
        table = F.pad(table, (0, 1))
    return table


@register_model("transformer_lm", dataclass=TransformerLMConfig)
class TransformerLanguageModel(HFConvertible, DecoderInterface, nn.Module):
    supports_fused_loss = True  # forward(..., loss_target=): the head and the loss in one chunked pass

    def __init__(self, cfg: TransformerLMConfig, vocab_size: int, padding_idx: int, seed: Optional[int] = None):
        """Built on the meta device, parameters stay uninitialized (materialize, then ``init_weights``).

        Otherwise the parameters are set by ``init_weights(self, seed)``; ``seed`` defaults to
        ``torch.initial_seed()``, so ``torch.manual_seed(s)`` then building gives the same model as
        ``init_weights(model, s)``.
        """
        super().__init__()
        if cfg.max_target_positions is None:
            raise ValueError("max_target_positions must be set (build_model takes it from --tokens-per-sample)")
        self.cfg = cfg
        self.padding_idx = padding_idx
        self.max_target_positions = cfg.max_target_positions
        self.attention_dropout = cfg.attention_dropout
        C = cfg.decoder_embed_dim
        C_in, C_out = cfg.decoder_input_dim or C, cfg.decoder_output_dim or C
        self.embed_scale = 1.0 if cfg.no_scale_embedding else math.sqrt(C)
        self.dropout = cfg.dropout
        keep = parse_layers_to_keep(cfg.decoder_layers_to_keep)  # fairseq: build only the kept layers
        num_layers = len(keep) if keep is not None else cfg.decoder_layers
        adaptive.check_tying(cfg, vocab_size)

        # Modules are created on the meta device (no memory, and none of torch's default init,
        # which init_weights would overwrite anyway), then materialized where the caller builds.
        device = torch.empty(0).device  # the caller's default device (meta under `with torch.device("meta")`)
        with torch.device("meta"):
            self.embed_tokens = self._token_embedding(cfg, vocab_size, padding_idx, C_in)
            embedded = self.embed_tokens.embedding_dim  # C_in, or C from an adaptive input
            self.project_in_dim = nn.Linear(embedded, C, bias=False) if embedded != C else None
            self.embed_positions: Optional[nn.Embedding] = None
            sinusoidal = None  # computed, not trained, not saved: rebuilt by reset_buffers()
            if not cfg.no_token_positional_embeddings:
                if cfg.decoder_learned_pos:
                    self.embed_positions = meta_embedding(cfg.max_target_positions + padding_idx + 1, C)
                else:
                    sinusoidal = torch.empty(cfg.max_target_positions, C)
            self.register_buffer("sinusoidal_positions", sinusoidal, persistent=False)
            self.layernorm_embedding = nn.LayerNorm(C) if cfg.layernorm_embedding else None
            self.layer_drop = LayerDrop(cfg.decoder_layerdrop)
            self.layers = nn.ModuleList([TransformerBlock(cfg) for _ in range(num_layers)])
            use_final_norm = cfg.decoder_normalize_before and not cfg.no_decoder_final_norm
            self.layer_norm = nn.LayerNorm(C) if use_final_norm else None
            self.project_out_dim = (
                nn.Linear(C, C_out, bias=False) if C_out != C and not cfg.tie_adaptive_weights else None
            )
            self.adaptive_softmax: Optional[AdaptiveSoftmax] = None
            self.output_projection: Optional[nn.Linear] = None
            self._build_output_layer(cfg, vocab_size, C_out)
        quant_noise.apply_quant_noise(self, cfg.quant_noise_pq, cfg.quant_noise_pq_block_size)
        if device.type != "meta":
            self.to_empty(device=device)
            init_weights(self, torch.initial_seed() if seed is None else seed)

    def _build_output_layer(self, cfg: TransformerLMConfig, vocab_size: int, dim: int) -> None:
        """fairseq's build_output_projection: an adaptive softmax, the tied embedding, or a [V, dim] projection."""
        if cfg.adaptive_softmax_cutoff is not None:
            cutoff = adaptive.parse_cutoff(cfg.adaptive_softmax_cutoff, vocab_size, "--adaptive-softmax-cutoff")
            tied = self.embed_tokens if cfg.tie_adaptive_weights else None
            self.adaptive_softmax = AdaptiveSoftmax(
                vocab_size,
                dim,
                cutoff,
                cfg.adaptive_softmax_dropout,
                cfg.adaptive_softmax_factor,
                tied,
                cfg.tie_adaptive_proj,
            )
        elif cfg.share_decoder_input_output_embed:
            # Tied: the output projection is embed_tokens.weight itself (one parameter, see forward).
            if cfg.adaptive_input or dim != self.embed_tokens.embedding_dim:
                raise UserError(
                    "--share-decoder-input-output-embed: needs a plain embedding of "
                    "--decoder-output-dim's size (use --tie-adaptive-weights with adaptive input)"
                )
        else:
            self.output_projection = nn.Linear(dim, vocab_size, bias=False)

    @staticmethod
    def _token_embedding(cfg: TransformerLMConfig, vocab_size: int, padding_idx: int, dim: int) -> nn.Module:
        if not cfg.adaptive_input:
            return meta_embedding(vocab_size, dim, padding_idx=padding_idx)
        cutoff = adaptive.parse_cutoff(cfg.adaptive_input_cutoff, vocab_size, "--adaptive-input-cutoff")
        return AdaptiveInput(vocab_size, padding_idx, dim, cfg.adaptive_input_factor, cfg.decoder_embed_dim, cutoff)

    def forward(
        self,
        tokens: torch.Tensor,
        incremental_state: Optional[Dict] = None,
        document_ids: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        loss_target: Optional[LossTarget] = None,
    ) -> Any:
        """tokens: LongTensor [B, T] (right-padded) -> logits [B, T, V].

        ``loss_target`` (the criterion's): the summed NLL of those targets instead of the logits, the head and
        the loss fused (``DecoderInterface.fused_head_loss``); with an adaptive softmax, its own summed loss.

        ``document_ids`` [B, T]: attention stays inside each document; ``positions`` [B, T]: each
        token's position (restarting per document), instead of 0..T-1 (``toolkit.models.document_mask``).

        With an adaptive softmax and no ``loss_target``: the features [B, T, C_out] it scores (as fairseq's
        decoder); ``get_normalized_probs`` turns them into probabilities.
        With ``incremental_state`` (a dict, empty at the first call, then owned by the model:
        ``"positions"`` cached so far and one ``KVCache`` per layer under ``"layers"``),
        ``tokens`` are only the new tokens; their positions continue after the cached ones.
        """
        start, T = self._first_position(tokens, incremental_state), tokens.size(1)
        x = self.embed_tokens(tokens)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        if self.project_in_dim is not None:
            x = self.project_in_dim(x)
        if positions is None:
            positions = torch.arange(start, start + T, device=tokens.device)  # [T], broadcast over the batch
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions + self.padding_idx + 1)
        elif self.sinusoidal_positions is not None:
            x = x + self.sinusoidal_positions[positions]
        if self.layernorm_embedding is not None:
            x = self.layernorm_embedding(x)
        if self.dropout > 0 and self.training:
            x = F.dropout(x, self.dropout, training=True)
        caches = self._layer_caches(incremental_state)
        mask = attention_mask(
            document_ids,
            T,
            tokens.device,
            head_dim=self.cfg.decoder_embed_dim // self.cfg.decoder_attention_heads,
            dropout=self.attention_dropout if self.training else 0.0,
        )
        for layer, keep, cache in zip(self.layers, self.layer_drop.keep(len(self.layers)), caches):
            if keep:  # LayerDrop: in training a whole layer may be skipped
                if cache is not None:
                    x = layer(x, cache)
                else:
                    x = layer(x) if mask is None else layer(x, attn_mask=mask)
        if incremental_state is not None:
            incremental_state["positions"] = start + T
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        if self.project_out_dim is not None:
            x = self.project_out_dim(x)
        if self.adaptive_softmax is not None:  # its head and loss are one module: the loss where it is asked for
            if loss_target is None:
                return x
            return with_summed_nll(self.adaptive_softmax.loss(x, loss_target.target, loss_target.ignore_index))
        weight = self.embed_tokens.weight if self.output_projection is None else self.output_projection.weight
        fused = self.fused_head_loss(x, weight, loss_target)
        if fused is not None:
            return fused
        if self.output_projection is None:
            return F.linear(x, self.embed_tokens.weight)
        return self.output_projection(x)

    def get_normalized_probs(self, net_output, log_probs: bool = True) -> torch.Tensor:
        """fp32 [B, T, V] (log-)probabilities of the next token, from ``forward``'s output."""
        x = net_output[0] if isinstance(net_output, (tuple, list)) else net_output
        if self.adaptive_softmax is not None:
            logp = self.adaptive_softmax.get_log_prob(x)
            return logp if log_probs else logp.exp()
        return F.log_softmax(x.float(), dim=-1) if log_probs else F.softmax(x.float(), dim=-1)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``--decoder-layers-to-keep``: a full checkpoint's kept layers load as this model's layers."""
        keep = parse_layers_to_keep(self.cfg.decoder_layers_to_keep)
        if keep is not None:
            state_dict = prune_state_dict(state_dict, keep, len(self.layers))
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    # ---- initialization (driven by toolkit.models.init.init_weights) ----

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after ``to_empty``; init_weights calls this)."""
        if self.sinusoidal_positions is not None:
            buf = self.sinusoidal_positions
            buf.copy_(sinusoidal_table(buf.size(0), buf.size(1), self.padding_idx + 1, device=buf.device))

    def initial_value(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """The full initial fp32 value of parameter ``name`` (fairseq's init rules), drawn from ``generator``.

        Embeddings ~ N(0, C^-0.5) with the padding row zeroed; linear weights Xavier-uniform
        (q/k/v with gain 1/sqrt(2), per fairseq's MultiheadAttention); biases 0; LayerNorm 1/0.
        """
        C = self.cfg.decoder_embed_dim
        if name.endswith(".bias"):
            return torch.zeros(shape)
        if "layer_norm" in name or name == "layernorm_embedding.weight":
            return torch.ones(shape)
        if name.startswith(("embed_tokens.embeddings.", "adaptive_softmax.")):
            return adaptive.initial_value(name, shape, generator, self.padding_idx)
        if name in ("embed_tokens.weight", "embed_positions.weight", "output_projection.weight"):
            w = torch.empty(shape).normal_(0.0, shape[1] ** -0.5, generator=generator)
            if name != "output_projection.weight":
                w[self.padding_idx] = 0.0
            return w
        if name.endswith("qkv_proj.weight"):  # three stacked [C, C] blocks
            bound = math.sqrt(6.0 / (C + C)) / math.sqrt(2.0)
        elif name.endswith(
            ("out_proj.weight", "fc1.weight", "fc2.weight", "project_in_dim.weight", "project_out_dim.weight")
        ):
            bound = math.sqrt(6.0 / (shape[0] + shape[1]))
        else:
            raise KeyError(f"no initialization rule for parameter {name}")
        return torch.empty(shape).uniform_(-bound, bound, generator=generator)

    no_decay_norms_biases_embeddings_by_default = False  # fairseq decays every parameter: kept for parity

    def parameter_roles(self) -> Dict[str, str]:
        """What each parameter is to the optimizer (``toolkit.core.protocols.ParameterRoles``): the token and
        position tables (adaptive input's bands too) are embeddings, the output head (or adaptive softmax) the
        output; the blocks' and the dimension projections' weights are Muon's matrices."""
        return roles_by_prefix(
            self, embeddings=("embed_tokens.", "embed_positions."), outputs=("output_projection.", "adaptive_softmax.")
        )

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        """Megatron's split of this model's modules (``parallel.py``), for ``--model-parallel-size``."""
        return family_plan(self)

    # ---- export (hf.py's adapter class; onnx_decoder.py imported when asked) ----

    HF_ADAPTER = TransformerLMAdapter  # --from hf: GPT-2 (hf_import.py); --format hf: XGLM, OPT or GPT-2 (hf.py)

    def onnx_cached_decoder(self) -> nn.Module:
        """``--format onnx --kv-cache``: the forward after P cached positions (``onnx_decoder.py``)."""
        from toolkit.models.transformer_lm.onnx_decoder import CachedDecoder

        return CachedDecoder(self)

    QUANT_NOISE_LINEARS = ("qkv_proj", "out_proj", "fc1", "fc2")  # --quant-noise-pq covers these, as fairseq does

    # ---- accounting ----

    def meta_traceable_options(self) -> Dict[str, Any]:
        """A full embedding and softmax in place of adaptive ones (``toolkit-plan``'s activations; an upper bound)."""
        cfg = self.cfg
        if not (cfg.adaptive_input or cfg.adaptive_softmax_cutoff):
            return {}
        return dict(adaptive_input=False, adaptive_softmax_cutoff=None, tie_adaptive_weights=False)

    def position_parameters(self) -> Tuple[str, ...]:
        """The learned position table, looked up and never in a matmul (``toolkit-plan``'s autocast copies)."""
        return ("embed_positions.weight",) if self.embed_positions is not None else ()

    def num_matmul_parameters(self) -> int:
        """Weights used in matmuls per token: everything except embedding lookups, plus the output
        layer (``embed_tokens.weight`` when tied; the adaptive softmax's head and, by each tail
        band's expected share of tokens, its tails). The N in 6N FLOPs per token."""
        from toolkit.models.transformer_lm.accounting import matmul_parameters_per_token

        return matmul_parameters_per_token(self)

    def flops_per_token(self, seq_len: int) -> int:
        return flops_per_token(self.cfg, seq_len, self.num_matmul_parameters(), len(self.layers))


def flops_per_token(
    cfg: TransformerLMConfig, seq_len: int, num_matmul_params: int, num_layers: Optional[int] = None
) -> int:
    """Training FLOPs per token, PaLM appendix B: 6N + 12·L·C·T.

    N counts weights in matmuls (output projection included, embedding lookups not; see
    ``TransformerLanguageModel.num_matmul_parameters``). 12·L·C·T is attention's QK^T and AV
    (forward 4·L·C·T, times 3 with backward), counted without halving for the causal mask.
    """
    layers = cfg.decoder_layers if num_layers is None else num_layers
    return int(6 * num_matmul_params + 12 * layers * cfg.decoder_embed_dim * seq_len)
