"""Adaptive input (Baevski & Auli, 2019) and adaptive softmax (Grave et al., 2017), as fairseq's.

The vocabulary, sorted by frequency (fairseq's dictionaries are), is cut into bands at
``cutoff`` (the vocabulary size is appended when the last cutoff is below it). Band ``i``
gets a smaller dimension, ``dim // factor**i``: rare words get few parameters and, in the
softmax, are scored only for the positions whose target falls in their band.

Parameter names and shapes are fairseq's (``fairseq/modules/adaptive_input.py``,
``adaptive_softmax.py``), under the model's ``embed_tokens.`` / ``adaptive_softmax.``
(fairseq's ``decoder.embed_tokens.`` / ``decoder.adaptive_softmax.``)::

    embed_tokens.embeddings.{i}.0.weight   [band_size_i, dim_i]   band i's embedding
    embed_tokens.embeddings.{i}.1.weight   [C, dim_i]             its projection to C (no bias)
    adaptive_softmax.head.weight           [cutoff[0] + n_tails, C_out]      untied head
    adaptive_softmax.head.class_proj.weight   [n_tails, C_out]   tied head: the tail clusters' scores
    adaptive_softmax.head.word_proj.0.weight  [dim_0, C_out]     tied head when C_out != dim_0
    adaptive_softmax.tail.{i}.0.weight     [dim_{i+1}, C_out]    tail projection (untied)
    adaptive_softmax.tail.{i}.2.weight     [band_size_{i+1}, dim_{i+1}]  tail output (untied)

With ``--tie-adaptive-weights`` the head's word scores use ``embed_tokens.embeddings.0.0.weight``
and tail ``i``'s output uses ``embed_tokens.embeddings.{i+1}.0.weight``; with
``--tie-adaptive-proj`` tail ``i``'s projection is ``embed_tokens.embeddings.{i+1}.1.weight``
transposed. A tied weight has one name here (the adaptive input's): fairseq's state dicts
also list it under the softmax's name (``head.word_proj.weight``, ``head.word_proj.1.weight``,
``tail.{i}.0.weight``, ``tail.{i}.2.weight``); ``from_fairseq_state_dict`` drops those aliases
and ``to_fairseq_state_dict`` writes them back. fairseq's buffers (``_float_tensor``,
``version``) hold no model values and are dropped / re-created the same way.

Every band always runs, on zero rows when no token of the batch falls in it: the result is
fairseq's, and every parameter takes part in every backward, which DDP (``--ddp-backend c10d``)
requires (fairseq refuses c10d with adaptive softmax for that reason).
"""

from __future__ import annotations

import math
import re
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from toolkit.core.errors import UserError


def parse_cutoff(text: Optional[str], vocab_size: int, flag: str) -> List[int]:
    """fairseq's ``eval_str_list`` of a comma-separated cutoff, with the vocabulary size appended."""
    if text is None or str(text).strip() == "":
        raise UserError(f"{flag}: required, e.g. '20000,60000' (comma-separated band boundaries)")
    try:
        cutoff = [int(v) for v in str(text).strip("[]() ").split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated integers such as '20000,60000', got {text!r}") from None
    if not cutoff or any(b <= a for a, b in zip([0] + cutoff, cutoff)):
        raise UserError(f"{flag}: band boundaries must be positive and increasing, got {text!r}")
    if cutoff[-1] > vocab_size:
        raise UserError(f"{flag}: cutoff {cutoff[-1]} is larger than the vocabulary ({vocab_size} symbols); lower it")
    return cutoff + [vocab_size] if cutoff[-1] < vocab_size else cutoff


def band_dims(dim: int, factor: float, bands: int) -> List[int]:
    """fairseq's per-band dimension: ``int(dim // factor**i)``."""
    return [int(dim // (factor**i)) for i in range(bands)]


def _band_rows(tokens: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return torch.nonzero((tokens >= lo) & (tokens < hi)).squeeze(1)


class AdaptiveInput(nn.Module):
    """Token embeddings of dimension ``output_dim`` built from per-band embeddings and projections."""

    def __init__(
        self, vocab_size: int, padding_idx: int, initial_dim: int, factor: float, output_dim: int, cutoff: List[int]
    ):
        super().__init__()
        self.cutoff = cutoff
        self.padding_idx = padding_idx
        self.embedding_dim = output_dim
        self.embeddings = nn.ModuleList()
        for i, dim in enumerate(band_dims(initial_dim, factor, len(cutoff))):
            size = cutoff[i] - (cutoff[i - 1] if i > 0 else 0)
            self.embeddings.append(
                nn.Sequential(
                    nn.Embedding(size, dim, padding_idx if i == 0 else None),  # fairseq: padding row in band 0 only
                    nn.Linear(dim, output_dim, bias=False),
                )
            )

    def weights_for_band(self, band: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.embeddings[band][0].weight, self.embeddings[band][1].weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        flat = tokens.reshape(-1)
        rows, outs = [], []
        for i, band in enumerate(self.embeddings):
            lo = self.cutoff[i - 1] if i > 0 else 0
            idx = _band_rows(flat, lo, self.cutoff[i])
            rows.append(idx)
            outs.append(band(flat[idx] - lo))
        out = torch.cat(outs)
        out = out.new_empty(out.shape).index_copy(0, torch.cat(rows), out)
        return out.view(*tokens.shape, self.embedding_dim)


class TiedLinear(nn.Module):
    """``x @ W.T`` (``x @ W`` if ``transpose``) with ``W`` a parameter of another module.

    The owner is held outside the module tree, so the weight keeps one name (the owner's)
    and the value is read at call time (FSDP2 swaps parameters in and out of their modules).
    """

    def __init__(self, owner: nn.Module, name: str, transpose: bool = False):
        super().__init__()
        self._owner = (owner,)  # a tuple: not registered as a submodule
        self.name = name
        self.transpose = transpose

    def tied_weight(self) -> torch.Tensor:
        return self._owner[0].get_parameter(self.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.tied_weight()
        return F.linear(x, w.t() if self.transpose else w)

    def extra_repr(self) -> str:
        return f"tied to {self.name}{'.T' if self.transpose else ''}"


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The [out, in] weight a Linear or (untransposed) TiedLinear applies."""
    return module.tied_weight() if isinstance(module, TiedLinear) else module.weight


class TiedHead(nn.Module):
    """fairseq's TiedHeadModule: word scores from the band-0 embedding, cluster scores from ``class_proj``."""

    def __init__(self, adaptive_input: AdaptiveInput, input_dim: int, num_classes: int):
        super().__init__()
        band0_dim = adaptive_input.embeddings[0][0].embedding_dim
        word = TiedLinear(adaptive_input, "embeddings.0.0.weight")
        self.word_proj = (
            word if input_dim == band0_dim else nn.Sequential(nn.Linear(input_dim, band0_dim, bias=False), word)
        )
        self.class_proj = nn.Linear(input_dim, num_classes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.word_proj(x), self.class_proj(x)], dim=-1)


class AdaptiveSoftmax(nn.Module):
    """Head: the ``cutoff[0]`` most frequent words plus one score per tail band; tails: the rest, by band.

    log p(w) = log p_head(w) for a head word, log p_head(band of w) + log p_band(w) otherwise.
    Dropout ``dropout`` applies to the input (all of it, as fairseq's) and again after each tail projection.
    """

    def __init__(
        self,
        vocab_size: int,
        input_dim: int,
        cutoff: List[int],
        dropout: float,
        factor: float = 4.0,
        adaptive_input: Optional[AdaptiveInput] = None,
        tie_proj: bool = False,
    ):
        super().__init__()
        self.vocab_size, self.input_dim, self.cutoff = vocab_size, input_dim, cutoff
        self.dropout = dropout
        n_tails = len(cutoff) - 1
        if adaptive_input is not None:
            self.head: nn.Module = TiedHead(adaptive_input, input_dim, n_tails)
        else:
            self.head = nn.Linear(input_dim, cutoff[0] + n_tails, bias=False)
        self.tail = nn.ModuleList(self._tail(i, factor, adaptive_input, tie_proj) for i in range(n_tails))

    def _tail(self, i: int, factor: float, adaptive_input: Optional[AdaptiveInput], tie_proj: bool) -> nn.Sequential:
        size = self.cutoff[i + 1] - self.cutoff[i]
        if adaptive_input is None:
            dim = int(self.input_dim // factor ** (i + 1))
            return nn.Sequential(
                nn.Linear(self.input_dim, dim, bias=False), nn.Dropout(self.dropout), nn.Linear(dim, size, bias=False)
            )
        emb, proj = adaptive_input.weights_for_band(i + 1)  # [size, dim], [C, dim]
        band = f"embeddings.{i + 1}"
        projection = (
            TiedLinear(adaptive_input, f"{band}.1.weight", transpose=True)
            if tie_proj
            else nn.Linear(proj.size(0), proj.size(1), bias=False)
        )
        return nn.Sequential(projection, nn.Dropout(self.dropout), TiedLinear(adaptive_input, f"{band}.0.weight"))

    def _targets(self, target: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """The head's target (a tail word becomes its band's cluster id) and the rows of each tail band."""
        head_target = target.clone()
        rows = []
        for i in range(len(self.tail)):
            idx = _band_rows(target, self.cutoff[i], self.cutoff[i + 1])
            head_target[idx] = self.cutoff[0] + i
            rows.append(idx)
        return head_target, rows

    def forward(self, features: torch.Tensor, target: torch.Tensor) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """Scores and targets per part, fairseq's ``(output, new_target)``: ``[head, tail_0, ...]``.

        ``features`` [B, T, C_out] and ``target`` [B, T] are flattened; tail ``i`` scores only the
        rows whose target is in its band (possibly none), against targets shifted to the band.
        """
        outputs, targets, _ = self._parts(features, target)
        return outputs, targets

    def _parts(self, features: torch.Tensor, target: torch.Tensor):
        x = features.reshape(-1, features.size(-1))
        x = F.dropout(x, self.dropout, training=self.training)
        target = target.reshape(-1)
        head_target, rows = self._targets(target)
        outputs, targets = [self.head(x)], [head_target]
        for i, idx in enumerate(rows):
            outputs.append(self.tail[i](x.index_select(0, idx)))
            targets.append(target.index_select(0, idx) - self.cutoff[i])
        return outputs, targets, rows

    def loss(
        self, features: torch.Tensor, target: torch.Tensor, ignore_index: int, reduce: bool = True
    ) -> torch.Tensor:
        """NLL in nats (fp32) of ``target``: summed, or per position [B*T] when not ``reduce``.

        ``ignore_index`` (the padding) applies to the head only: padding is a head word, and a tail
        target equal to it after the shift is a real word (fairseq also ignores it there, which
        drops word ``cutoff[i] + padding_idx`` of every tail band from its loss).
        """
        outputs, targets, rows = self._parts(features, target)
        reduction = "sum" if reduce else "none"
        loss = F.cross_entropy(outputs[0].float(), targets[0], ignore_index=ignore_index, reduction=reduction)
        for idx, out, tgt in zip(rows, outputs[1:], targets[1:]):
            tail = F.cross_entropy(out.float(), tgt, reduction=reduction)
            loss = loss + tail if reduce else loss.index_add(0, idx, tail)
        return loss

    def get_log_prob(self, features: torch.Tensor) -> torch.Tensor:
        """fp32 log-probabilities of the whole vocabulary [B, T, V] (no input dropout, as fairseq's)."""
        B, T, C = features.shape
        x = features.reshape(-1, C)
        head = F.log_softmax(self.head(x).float(), dim=-1)
        n_head = self.cutoff[0]
        parts = [head[:, :n_head]]
        for i, tail in enumerate(self.tail):
            prior = head[:, n_head + i, None]
            parts.append(F.log_softmax(tail(x).float(), dim=-1) + prior)
        return torch.cat(parts, dim=-1).view(B, T, self.vocab_size)


# ---- initialization (fairseq's rules), called from the model's initial_value ----


def initial_value(name: str, shape: torch.Size, generator: torch.Generator, padding_idx: int) -> torch.Tensor:
    """Band embeddings ~ N(0, dim^-0.5), row ``padding_idx`` zero in every band (fairseq's init applies
    the padding row to each band's nn.Embedding); every projection Xavier-uniform."""
    if re.fullmatch(r"embed_tokens\.embeddings\.\d+\.0\.weight", name):
        w = torch.empty(shape).normal_(0.0, shape[1] ** -0.5, generator=generator)
        if padding_idx < shape[0]:
            w[padding_idx] = 0.0
        return w
    if name.startswith(("embed_tokens.embeddings.", "adaptive_softmax.")) and name.endswith(".weight"):
        bound = math.sqrt(6.0 / (shape[0] + shape[1]))
        return torch.empty(shape).uniform_(-bound, bound, generator=generator)
    raise KeyError(f"no initialization rule for parameter {name}")


# ---- fairseq's state-dict layout ----

FAIRSEQ_BUFFERS = ("embed_tokens._float_tensor", "adaptive_softmax.head._float_tensor", "adaptive_softmax.version")


def tied_aliases(model: nn.Module) -> Dict[str, str]:
    """fairseq's names of tied adaptive weights -> our (the adaptive input's) names, without prefix."""
    asm = model.adaptive_softmax
    out: Dict[str, str] = {}
    if asm is None:
        return out
    for name, module in asm.named_modules():
        if isinstance(module, TiedLinear):
            out[f"adaptive_softmax.{name}.weight"] = f"embed_tokens.{module.name}"
    return out


def from_fairseq_state_dict(
    state: Dict[str, torch.Tensor], model: nn.Module, prefix: str = "decoder."
) -> Dict[str, torch.Tensor]:
    """The adaptive-input / adaptive-softmax entries of a fairseq ``transformer_lm`` state dict, renamed
    for ``model``: ``decoder.`` dropped, tied aliases and buffers dropped (a tied alias must equal its
    source). Other keys pass through with the prefix dropped (the fairseq-import path maps those)."""
    aliases = tied_aliases(model)
    out: Dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = key[len(prefix) :] if key.startswith(prefix) else key
        if name in FAIRSEQ_BUFFERS:
            continue
        if name in aliases:
            source = state.get(prefix + aliases[name])
            if source is not None and not torch.equal(source, value):
                raise UserError(f"{key}: tied to {prefix + aliases[name]} but holds a different value")
            continue
        out[name] = value
    return out


def to_fairseq_state_dict(
    state: Dict[str, torch.Tensor], model: nn.Module, prefix: str = "decoder."
) -> Dict[str, torch.Tensor]:
    """Our state dict in fairseq's layout: prefix added, tied aliases and fairseq's buffers written."""
    out = {prefix + k: v for k, v in state.items()}
    for alias, source in tied_aliases(model).items():
        out[prefix + alias] = state[source]
    if model.adaptive_softmax is not None:
        out[prefix + "adaptive_softmax.version"] = torch.LongTensor([1])
        if isinstance(model.adaptive_softmax.head, TiedHead):
            out[prefix + "adaptive_softmax.head._float_tensor"] = torch.zeros(1)
    if isinstance(model.embed_tokens, AdaptiveInput):
        out[prefix + "embed_tokens._float_tensor"] = torch.zeros(1)
    return out


def check_tying(cfg, vocab_size: int) -> None:
    """fairseq's asserts for ``--tie-adaptive-weights``, as one-line errors."""
    if not cfg.tie_adaptive_weights:
        return
    if not cfg.adaptive_input:
        raise UserError("--tie-adaptive-weights: needs --adaptive-input (the softmax ties to its bands)")
    if cfg.adaptive_softmax_cutoff is None:
        raise UserError("--tie-adaptive-weights: needs --adaptive-softmax-cutoff")
    if cfg.adaptive_input_factor != cfg.adaptive_softmax_factor:
        raise UserError(
            f"--tie-adaptive-weights: --adaptive-input-factor ({cfg.adaptive_input_factor}) must "
            f"equal --adaptive-softmax-factor ({cfg.adaptive_softmax_factor})"
        )
    C = cfg.decoder_embed_dim
    dims = (cfg.decoder_input_dim or C, cfg.decoder_output_dim or C)
    if dims[0] != dims[1] or dims[1] != C:  # fairseq asserts the first; without project_out_dim it needs the second
        raise UserError(
            f"--tie-adaptive-weights: --decoder-input-dim ({dims[0]}) and --decoder-output-dim "
            f"({dims[1]}) must equal --decoder-embed-dim ({C}) (tied, there is no output projection)"
        )
    a = parse_cutoff(cfg.adaptive_input_cutoff, vocab_size, "--adaptive-input-cutoff")
    b = parse_cutoff(cfg.adaptive_softmax_cutoff, vocab_size, "--adaptive-softmax-cutoff")
    if a != b:
        raise UserError(
            f"--tie-adaptive-weights: --adaptive-input-cutoff ({cfg.adaptive_input_cutoff}) must "
            f"equal --adaptive-softmax-cutoff ({cfg.adaptive_softmax_cutoff})"
        )


def band_token_shares(cutoff: Sequence[int]) -> List[float]:
    """Expected share of tokens per band under Zipf's law (p(rank r) ~ 1/r), for FLOP estimates."""

    def harmonic(n: int) -> float:
        return math.log(n) + 0.5772156649 + 1.0 / (2 * n) if n > 0 else 0.0

    total = harmonic(cutoff[-1])
    edges = [0] + list(cutoff)
    return [(harmonic(hi) - harmonic(lo)) / total for lo, hi in zip(edges, edges[1:])]
