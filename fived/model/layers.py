"""Reference (one-rank) building blocks: linear, embedding, RMSNorm, RoPE, attention core, loss.

Parallel dimensions provide drop-in replacements through ``fived.parallel.plan.Plan``; these are
what a plan of one rank returns. Every weight is created from (seed, name) by
``fived.model.init.full_param`` and then sliced, so the layout never changes the model.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .init import full_param, shard


class Linear(nn.Module):
    """y = x Wᵀ, W of shape (out, in); optionally a slice ``index`` of ``parts`` along ``dim``."""

    def __init__(self, name: str, in_f: int, out_f: int, std: float, seed: int,
                 dim: int = 0, parts: int = 1, index: int = 0, dtype=torch.float32):
        super().__init__()
        w = shard(full_param(seed, name + ".weight", (out_f, in_f), std), dim, parts, index)
        self.weight = nn.Parameter(w.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Embedding(nn.Module):
    def __init__(self, name: str, vocab: int, hidden: int, std: float, seed: int,
                 dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(full_param(seed, name + ".weight", (vocab, hidden), std).to(dtype))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · g, computed in fp32."""

    def __init__(self, name: str, hidden: int, eps: float, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float,
                dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (s, head_dim/2) for the (possibly non-contiguous) ``positions``."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the head dimension; x is (b, s, heads, d)."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    c, s = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √d + causal mask) v with grouped-query heads; (b, s, h, d) in and out."""
    rep = q.shape[2] // k.shape[2]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
        scale=1.0 / math.sqrt(q.shape[-1]),
    )
    return o.transpose(1, 2)


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of the cross-entropy, in fp32."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="sum")
