"""A toy of latent attention's cache layout for the attention package's tests: a variant whose positions leave
something other than k and v (what the KV cache and the context-parallel exchange must carry as the variant says)."""

import torch
import torch.nn as nn

from toolkit.models.common.rope import apply_rope
from toolkit.models.common.attention import AttentionLayer


class LatentAttention(AttentionLayer):
    """A toy of latent attention's layout (not DeepSeek's arithmetic): each position leaves one compressed vector
    [B, 1, T, r] and a shared rotated key part [B, 1, T, Dr]; keys and values are expanded from them per head."""

    def __init__(self, dim=32, heads=4, rank=6, nope=8, rope=4):
        super().__init__()
        self.heads, self.nope, self.rope = heads, nope, rope
        self.q_proj = nn.Linear(dim, heads * (nope + rope), bias=False)
        self.kv_down = nn.Linear(dim, rank + rope, bias=False)
        self.kv_up = nn.Linear(rank, heads * (nope + nope), bias=False)
        self.o_proj = nn.Linear(heads * nope, dim, bias=False)

    def project(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, -1).transpose(1, 2)
        q = torch.cat([q[..., : self.nope], apply_rope(q[..., self.nope :], cos, sin)], -1)
        latent, k_rope = self.kv_down(x)[:, None].split([self.kv_up.in_features, self.rope], -1)
        return q, (latent, apply_rope(k_rope, cos, sin)), None

    def keys_values(self, entries):
        latent, k_rope = entries
        B, _, S, _ = latent.shape
        k_nope, v = self.kv_up(latent[:, 0]).view(B, S, self.heads, -1).transpose(1, 2).split(self.nope, -1)
        return torch.cat([k_nope, k_rope.expand(-1, self.heads, -1, -1)], -1), v

    def output(self, y, carry):
        return self.o_proj(y.transpose(1, 2).flatten(2))

    def kv_width(self):
        return self.kv_down.out_features
