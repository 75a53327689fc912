"""Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5: a per-head state S [Dk, Dv] that each position
decays, corrects by the delta rule and reads with its query, instead of keys and values kept for every position.

Per position t and value head (B batch, T positions, Hk key heads, Hv value heads, Dk, Dv their sizes):

- ``in_proj_qkvz`` gives q, k [Hk, Dk], v, z [Hv, Dv] (Hugging Face's layout: per key head its q, k and the v, z of
  its Hv/Hk value heads), ``in_proj_ba`` b and a [Hv] (Qwen3-Next); or, with ``split_projections`` (Qwen3.5),
  ``in_proj_qkv`` q | k | v, ``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` each its own;
- q, k and v pass a short causal convolution over the positions (depthwise ``conv1d`` of ``conv_kernel`` taps, then
  SiLU); q and k are L2-normalized and shared by the Hv/Hk value heads of their key head, q scaled by Dk^-1/2;
- the decay g = -exp(A_log) softplus(a + dt_bias) (log space) and the learning rate beta = sigmoid(b);
- S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, and the output o_t = S_t^T q_t;
- ``norm``: RMSNorm of each head's o_t, times SiLU(z_t) (:class:`GatedRMSNorm`), then ``out_proj``.

:func:`chunk_gated_delta_rule` computes the recurrence in chunks of 64 positions (the WY form: a triangular solve
per chunk, then one state update per chunk), :func:`recurrent_gated_delta_rule` position by position (decoding);
both equal transformers' ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``. With
``document_ids`` the state and the convolution restart at each document's first position: exp(g) is 0 there (the
masks of the chunked form, never -inf in log space), so a document is computed as if it were alone.

The state is affine in the state a span starts from: running a span from [0 | I] (the identity in Dk extra value
columns, whose values are 0) gives its final state N and its transition M (final = M S_in + N) and its outputs'
response L (o = o_0 + L S_in) in one pass. Context parallelism uses this (:meth:`GatedDeltaNet.across_ranks`): each
cp rank runs its two chunks of the sequence (chunk r and 2C-1-r of 2C, ``toolkit.distributed.context_parallel``'s
load-balanced layout) from [0 | I], the (M, N) of every chunk are all-gathered over the cp group (one collective,
its backward an all-reduce), and each rank composes them in sequence order to the state its chunks start from; the
convolution's tails (the last Dconv - 1 inputs of each chunk) come with the same kind of gather. So the zig-zag
order costs nothing: no rank waits for another's recurrence.

Decoding keeps a :class:`RecurrentState` per layer (the convolution's last inputs and S), not a K/V cache.
flash-linear-attention's kernels are an optional extra on CUDA (``pip install flash-linear-attention``); the
PyTorch forms here run everywhere.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

logger = logging.getLogger(__name__)

CHUNK = 64  # positions per chunk of the WY form (transformers' and flash-linear-attention's)
FLA_HINT = (
    "flash-linear-attention is not installed: gated DeltaNet runs its PyTorch form; pip install flash-linear-attention"
)
_HINTED: list = []


def fla_chunk_kernel(device: torch.device) -> Any:
    """flash-linear-attention's chunked kernel on CUDA when installed, else None (one log line on CUDA without it)."""
    if device.type != "cuda":
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as kernel
    except ImportError:
        if not _HINTED:
            logger.warning(FLA_HINT)
            _HINTED.append(True)
        return None
    return kernel


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (flash-linear-attention's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _segments(starts: Optional[torch.Tensor], B: int, n: int, c: int, device: torch.device):
    """(same [B, 1, n, c, c]: i and j in one document; joined [B, 1, n, c]: i continues the chunk's incoming state;
    joined_last [B, 1, n, c]: j in the chunk's last position's document), or Nones without documents."""
    if starts is None:
        return None, None, None
    starts = starts.to(device)
    count = starts.long().cumsum(-1).view(B, 1, n, c)
    before = count[..., 0] - starts.view(B, 1, n, c)[..., 0].long()
    same = count.unsqueeze(-1) == count.unsqueeze(-2)
    return same, count == before.unsqueeze(-1), count == count[..., -1:]


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
    starts: Optional[torch.Tensor] = None,
    chunk_size: int = CHUNK,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule in chunks (fp32). q, k [B, T, H, Dk] (normalized, one per value head), v [B, T, H, Dv],
    g, beta [B, T, H]; ``initial_state`` [B, H, Dk, Dv]; ``starts`` [B, T] bool: a document begins there (the
    state restarts). -> (o [B, T, H, Dv] in v's dtype, final state [B, H, Dk, Dv] fp32)."""
    dtype = v.dtype
    B, T, H, Dk = k.shape
    Dv = v.size(-1)
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))
    q = q * Dk**-0.5
    pad = -T % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    if starts is not None:
        starts = F.pad(starts.bool(), (0, pad))
    n, c = (T + pad) // chunk_size, chunk_size
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(B, H, n, c, -1) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(B, H, n, c).cumsum(-1)
    same, joined, joined_last = _segments(starts, B, n, c, q.device)
    hidden = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    if same is not None:
        hidden = hidden | ~same
    pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(hidden, float("-inf")).exp()
    solve = (k_beta @ k.transpose(-1, -2)) * pairwise  # (I + its strictly lower part) is the WY system
    intra = (q @ k.transpose(-1, -2)) * pairwise
    from_start = cum.exp()  # decay from the chunk's start to each position
    to_end = (cum[..., -1:] - cum).exp()  # decay from each position to the chunk's end
    chunk_decay = cum[..., -1].exp()
    if joined is not None:
        from_start, to_end, chunk_decay = from_start * joined, to_end * joined_last, chunk_decay * joined[..., -1]
    u = torch.linalg.solve_triangular(solve, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(solve, k_beta * from_start.unsqueeze(-1), upper=False, unitriangular=True)
    q_read, k_write = q * from_start.unsqueeze(-1), k * to_end.unsqueeze(-1)
    state = q.new_zeros(B, H, Dk, Dv) if initial_state is None else initial_state.float()
    out = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out.append(q_read[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i, None, None] + k_write[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(out, dim=2).reshape(B, H, n * c, Dv)[:, :, :T]
    return o.transpose(1, 2).to(dtype), state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule position by position (decoding's form), the arguments and results
    :func:`chunk_gated_delta_rule`'s (no document starts: decoding continues one sequence)."""
    dtype = v.dtype
    B, T, H, Dk = k.shape
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))
    q = q * Dk**-0.5
    state = q.new_zeros(B, H, Dk, v.size(-1)) if initial_state is None else initial_state.float()
    out = []
    for t in range(T):
        state = state * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        delta = (v[:, :, t] - (state * k_t.unsqueeze(-1)).sum(-2)) * beta[:, :, t].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out.append((state * q[:, :, t].unsqueeze(-1)).sum(-2))
    return torch.stack(out, dim=2).transpose(1, 2).to(dtype), state


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, tail: Optional[torch.Tensor] = None, documents: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """SiLU of the depthwise causal convolution of x [B, T, C] by ``weight`` [C, 1, K]: position t mixes
    x[t-K+1..t], ``tail`` [B, K-1, C] the K-1 inputs before x (zeros when None). ``documents`` [B, K-1+T]: the
    document of each of the tail's and x's positions; a tap into another document reads nothing."""
    B, T, C = x.shape
    K = weight.size(-1)
    if tail is None:
        tail = x.new_zeros(B, K - 1, C)
    padded = torch.cat([tail.to(x.dtype), x], dim=1)
    taps = weight.view(C, K).to(x.dtype)
    out = x.new_zeros(B, T, C)
    for j in range(K):
        term = padded[:, j : j + T] * taps[:, j]
        if documents is not None:
            term = term * (documents[:, j : j + T] == documents[:, K - 1 :]).unsqueeze(-1).to(x.dtype)
        out = out + term
    return F.silu(out)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output times SiLU of its gate z (Qwen3-Next's ``RMSNormGated``): reduced in fp32, cast,
    scaled by ``weight`` (plain, initialized to 1), then gated in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class RecurrentState:
    """What decoding keeps of a gated DeltaNet layer (its "cache"): the convolution's last K-1 inputs [B, K-1, C]
    and the state [B, Hv, Dk, Dv], whatever the number of positions decoded."""

    def __init__(self):
        self.conv: Optional[torch.Tensor] = None
        self.state: Optional[torch.Tensor] = None

    def reorder(self, new_order: torch.Tensor) -> None:
        """Keep rows ``new_order`` (beam search)."""
        if self.state is not None:
            self.conv, self.state = self.conv[new_order], self.state[new_order]


class GatedDeltaNet(nn.Module):
    """The gated DeltaNet layer (see the module docstring); parameters by Hugging Face's names: ``in_proj_qkvz``,
    ``in_proj_ba`` (or ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), ``conv1d``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``. Called as an attention layer of a
    block (``x, cos, sin[, cache]``; the rotary tables unused); its ``attn_mask`` is the [B, T] bool of document
    starts (None: one document a row)."""

    def __init__(
        self,
        dim: int,
        key_heads: int,
        value_heads: int,
        key_dim: int,
        value_dim: int,
        conv_kernel: int,
        eps: float,
        split_projections: bool = False,
    ):
        super().__init__()
        self.key_heads, self.value_heads, self.key_dim, self.value_dim = key_heads, value_heads, key_dim, value_dim
        self.conv_kernel = conv_kernel
        self.conv_width = 2 * key_heads * key_dim + value_heads * value_dim
        self.split_projections = split_projections
        if split_projections:
            self.in_proj_qkv = nn.Linear(dim, self.conv_width, bias=False)
            self.in_proj_z = nn.Linear(dim, value_heads * value_dim, bias=False)
            self.in_proj_b = nn.Linear(dim, value_heads, bias=False)
            self.in_proj_a = nn.Linear(dim, value_heads, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(dim, 2 * key_heads * key_dim + 2 * value_heads * value_dim, bias=False)
            self.in_proj_ba = nn.Linear(dim, 2 * value_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_width, self.conv_width, conv_kernel, groups=self.conv_width, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(value_heads))
        self.A_log = nn.Parameter(torch.empty(value_heads))
        self.norm = GatedRMSNorm(value_dim, eps)
        self.out_proj = nn.Linear(value_heads * value_dim, dim, bias=False)

    def project(self, x: torch.Tensor):
        """x [B, T, C] -> (the convolution's input [B, T, conv_width] (q | k | v), z [B, T, Hv, Dv], b, a [B, T, Hv])."""
        Dk, Dv, r = self.key_dim, self.value_dim, self.value_heads // self.key_heads
        if self.split_projections:
            z = self.in_proj_z(x)
            return self.in_proj_qkv(x), z.view(*z.shape[:2], -1, Dv), self.in_proj_b(x), self.in_proj_a(x)
        qkvz = self.in_proj_qkvz(x)
        # x's positions, or all of them under sequence parallelism (the column-parallel projection gathers them);
        # the key heads' groups, this rank's under a tensor-parallel split
        B, T, _ = qkvz.shape
        qkvz = qkvz.view(B, T, -1, 2 * Dk + 2 * r * Dv)
        q, k, v, z = qkvz.split([Dk, Dk, r * Dv, r * Dv], dim=-1)
        b, a = self.in_proj_ba(x).view(B, T, -1, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        return mixed, z.reshape(B, T, -1, Dv), b.reshape(B, T, -1), a.reshape(B, T, -1)

    def tensor_parallel_channels(self, rank: int, ranks: int) -> torch.Tensor:
        """The convolution's channels (rows of ``conv1d.weight``, q | k | v) of tensor-parallel rank ``rank`` of
        ``ranks``: those of its contiguous block of key heads and of their value heads, the heads its column-parallel
        ``in_proj_qkvz`` and ``in_proj_ba`` give it (each key head's group whole in Hugging Face's layout)."""
        q_width, v_width = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        q_share, v_share = q_width // ranks, v_width // ranks
        starts = (rank * q_share, q_width + rank * q_share, 2 * q_width + rank * v_share)
        return torch.cat([torch.arange(s, s + n) for s, n in zip(starts, (q_share, q_share, v_share))])

    def rule_inputs(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """The convolution's output [B, T, conv_width] -> q, k [B, T, Hv, Dk] (normalized, repeated per value head),
        v [B, T, Hv, Dv], g, beta [B, T, Hv] (fp32)."""
        B, T, width = mixed.shape
        Dk, r = self.key_dim, self.value_heads // self.key_heads
        Hk = width // (2 * Dk + r * self.value_dim)  # this rank's key heads under a tensor-parallel split
        q, k, v = mixed.split([Hk * Dk, Hk * Dk, Hk * r * self.value_dim], dim=-1)
        q, k = (l2_normalized(t.reshape(B, T, Hk, Dk).float()).repeat_interleave(r, dim=2) for t in (q, k))
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return q, k, v.reshape(B, T, -1, self.value_dim), g, b.float().sigmoid()

    def output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o, z [B, T, Hv, Dv] -> [B, T, C]: the gated norm per head, then ``out_proj``."""
        return self.out_proj(self.norm(o.to(z.dtype), z).flatten(2))

    def forward(
        self,
        x: torch.Tensor,
        cos: Any = None,
        sin: Any = None,
        kv_cache: Optional[RecurrentState] = None,
        attn_mask: Optional[torch.Tensor] = None,
        context_parallel: Any = None,
    ) -> torch.Tensor:
        """x [B, T, C] -> [B, T, C]; ``attn_mask``: document starts [B, T] (bool); ``kv_cache``: decoding's
        :class:`RecurrentState`, continued; ``context_parallel``: this rank's chunks of the sequences."""
        mixed, z, b, a = self.project(x)
        if context_parallel is not None:
            return self.output(self.across_ranks(mixed, b, a, context_parallel), z)
        if kv_cache is not None:
            return self.output(self._decode(mixed, b, a, kv_cache), z)
        documents = None
        if attn_mask is not None:  # each position's document, the zero tail in the first one's
            count = attn_mask.long().cumsum(-1)
            documents = torch.cat([count[:, :1].expand(-1, self.conv_kernel - 1), count], dim=1)
        q, k, v, g, beta = self.rule_inputs(causal_conv(mixed, self.conv1d.weight, None, documents), b, a)
        kernel = fla_chunk_kernel(x.device) if attn_mask is None else None
        if kernel is not None:
            o, _ = kernel(q.to(v.dtype), k.to(v.dtype), v, g, beta.to(v.dtype), scale=self.key_dim**-0.5)
        else:
            o, _ = chunk_gated_delta_rule(q, k, v, g, beta, starts=attn_mask)
        return self.output(o, z)

    def _decode(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, cache: RecurrentState) -> torch.Tensor:
        """The new positions after the cached ones: the convolution from the cached tail, the rule from S."""
        tail = cache.conv
        conv = causal_conv(mixed, self.conv1d.weight, tail)
        window = mixed if tail is None else torch.cat([tail, mixed], dim=1)
        cache.conv = F.pad(window, (0, 0, max(0, self.conv_kernel - 1 - window.size(1)), 0))[
            :, -(self.conv_kernel - 1) :
        ]
        q, k, v, g, beta = self.rule_inputs(conv, b, a)
        rule = recurrent_gated_delta_rule if mixed.size(1) == 1 else chunk_gated_delta_rule
        o, cache.state = rule(q, k, v, g, beta, cache.state)
        return o

    def across_ranks(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, shard: Any) -> torch.Tensor:
        """This cp rank's two chunks of the sequence (``shard``: ``toolkit.distributed.context_parallel``'s
        ``ContextShard``; its ``gather`` all-gathers over the cp group with gradients) -> o [B, T/C, Hv, Dv], equal
        to one process's: the convolution's tails and the chunks' (M, N) are gathered, the state each chunk starts
        from composed in sequence order (see the module docstring)."""
        B, local, _ = mixed.shape
        c, K = local // 2, self.conv_kernel
        mine = (shard.query_index.view(2, c)[:, 0] // c).tolist()  # the global chunk of each of this rank's two
        gathered = shard.key_index.view(-1, c)[:, 0] // c
        order = torch.argsort(gathered)  # gathered slot of global chunk j
        starts = None
        if shard.document_ids is not None:
            docs = shard.document_ids
            starts = torch.zeros_like(docs, dtype=torch.bool)
            starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
        span = min(c, K - 1)
        tails = _gather_chunks(shard, mixed.view(B, 2, c, -1)[:, :, c - span :])[:, order]  # [B, 2C, span, W]
        tails = torch.cat([mixed.new_zeros(B, K - 1, mixed.size(-1)), tails.flatten(1, 2)], dim=1)
        pieces = []
        for slot, chunk in enumerate(mine):
            tail = tails[:, chunk * span : chunk * span + K - 1]  # the K-1 inputs before the chunk
            positions = torch.arange(chunk * c - (K - 1), chunk * c + c, device=mixed.device)
            documents = None if starts is None else shard.document_ids[:, positions.clamp(min=0)]
            conv = causal_conv(mixed[:, slot * c : (slot + 1) * c], self.conv1d.weight, tail, documents)
            chunk_starts = None if starts is None else starts[:, chunk * c : (chunk + 1) * c]
            pieces.append(
                self._affine_chunk(conv, b[:, slot * c : (slot + 1) * c], a[:, slot * c : (slot + 1) * c], chunk_starts)
            )
        transitions = _gather_chunks(shard, torch.stack([p[2] for p in pieces], dim=1))[:, order]
        entering = _entering_states(transitions, self.value_dim)
        outs = [
            o0 + torch.einsum("bthk,bhkv->bthv", response, entering[:, chunk])
            for (o0, response, _), chunk in zip(pieces, mine)
        ]
        return torch.cat(outs, dim=1)

    def _affine_chunk(self, conv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, starts: Optional[torch.Tensor]):
        """A chunk run from [0 | I]: (o_0 [B, c, Hv, Dv], the response L [B, c, Hv, Dk], [M | N] [B, Hv, Dk, Dk + Dv])."""
        q, k, v, g, beta = self.rule_inputs(conv, b, a)
        B, c, H, Dk = k.shape
        Dv = v.size(-1)
        v = torch.cat([v.float(), v.new_zeros(B, c, H, Dk, dtype=torch.float32)], dim=-1)
        identity = torch.eye(Dk, device=v.device).expand(B, H, Dk, Dk)
        start = torch.cat([v.new_zeros(B, H, Dk, Dv), identity], dim=-1)
        o, final = chunk_gated_delta_rule(q, k, v, g, beta, start, starts)
        return o[..., :Dv], o[..., Dv:], torch.cat([final[..., Dv:], final[..., :Dv]], dim=-1)


def _gather_chunks(shard: Any, x: torch.Tensor) -> torch.Tensor:
    """x [B, 2, ...] (this rank's two chunks) -> [B, 2C, ...] in the cp group's gathered order."""
    B, two = x.shape[:2]
    flat = x.reshape(B, two, -1)
    return shard.gather((flat,))[0].view(B, -1, *x.shape[2:])


def _entering_states(transitions: torch.Tensor, value_dim: int) -> torch.Tensor:
    """[M | N] of the 2C chunks in sequence order [B, 2C, Hv, Dk, Dk + Dv] -> the state each chunk starts from
    [B, 2C, Hv, Dk, Dv]: S_0 = 0, S_{j+1} = M_j S_j + N_j."""
    B, n, H, Dk, _ = transitions.shape
    state = transitions.new_zeros(B, H, Dk, value_dim)
    states = []
    for j in range(n):
        states.append(state)
        m, add = transitions[:, j, ..., :Dk], transitions[:, j, ..., Dk:]
        state = m @ state + add
    return torch.stack(states, dim=1)
