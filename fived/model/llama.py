"""A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, optional tied embeddings.

    h₀ = E[tokens]
    hᵢ₊₁ = hᵢ' + W_down( silu(W_gate n) ⊙ W_up n ),   n = RMSNorm(hᵢ'),
    hᵢ'  = hᵢ + W_o · Attn(RoPE(W_q m), RoPE(W_k m), W_v m),   m = RMSNorm(hᵢ)
    loss = Σ_tokens CE(W_head · RMSNorm(h_L), targets)

One ``Transformer`` is one pipeline stage: it holds the layers ``layer_ids`` (global indices, so
parameter names are the same on any split), the embedding when it is the first stage and the
final norm, head and loss when it is the last. With one stage it is the whole model.
Every layer comes from the ``Plan``, which decides whether it is the reference or a parallel cut.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from . import layers as L

STD = 0.02


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: Any, prefix: str):
        super().__init__()
        self.plan = plan
        hd = cfg.head_dim
        self.heads, self.kv_heads = plan.local_heads()
        kv_shards = min(plan.tp, cfg.kv_heads)
        out_std = STD / math.sqrt(2 * cfg.layers)
        self.wq = plan.column(prefix + "wq", cfg.hidden, cfg.heads * hd, STD)
        self.wk = plan.column(prefix + "wk", cfg.hidden, cfg.kv_heads * hd, STD, shards=kv_shards)
        self.wv = plan.column(prefix + "wv", cfg.hidden, cfg.kv_heads * hd, STD, shards=kv_shards)
        self.wo = plan.row(prefix + "wo", cfg.heads * hd, cfg.hidden, out_std)
        self.head_dim = hd

    def core(self, q, k, v):
        return self.plan.attention(q, k, v)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = rope
        q = self.wq(x)
        b, s = q.shape[0], q.shape[1]
        q = L.apply_rope(q.view(b, s, self.heads, self.head_dim), cos, sin)
        k = L.apply_rope(self.wk(x).view(b, s, self.kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        if self.plan.par.recompute == "selective":
            o = checkpoint(self.core, q, k, v, use_reentrant=False)
        else:
            o = self.core(q, k, v)
        return self.wo(o.reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: W_down(silu(W_gate x) ⊙ W_up x)."""

    def __init__(self, cfg: ModelConfig, plan: Any, prefix: str, ffn: int | None = None):
        super().__init__()
        ffn = ffn or cfg.ffn
        self.w_gate = plan.column(prefix + "w_gate", cfg.hidden, ffn, STD)
        self.w_up = plan.column(prefix + "w_up", cfg.hidden, ffn, STD)
        self.w_down = plan.row(prefix + "w_down", ffn, cfg.hidden, STD / math.sqrt(2 * cfg.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, plan: Any, index: int):
        super().__init__()
        p = f"layers.{index}."
        self.attn_norm = plan.norm(p + "attn_norm", cfg.hidden)
        self.attn = Attention(cfg, plan, p + "attn.")
        self.mlp_norm = plan.norm(p + "mlp_norm", cfg.hidden)
        if cfg.is_moe:
            from .moe import MoE

            self.mlp = MoE(cfg, plan, p + "mlp.")
        else:
            self.mlp = MLP(cfg, plan, p + "mlp.")

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), rope)
        return h + self.mlp(self.mlp_norm(h))


class Transformer(nn.Module):
    """One pipeline stage of the decoder (the whole model when it is both first and last)."""

    def __init__(self, cfg: ModelConfig, plan: Any, layer_ids: list[int] | None = None,
                 first: bool = True, last: bool = True):
        super().__init__()
        self.cfg, self.plan, self.first, self.last = cfg, plan, first, last
        ids = list(range(cfg.layers)) if layer_ids is None else list(layer_ids)
        self.layer_ids = ids
        if first:
            self.embed = plan.embedding("embed", STD)
        self.layers = nn.ModuleDict({str(i): Block(cfg, plan, i) for i in ids})
        if last:
            self.norm = plan.norm("norm", cfg.hidden)
            if cfg.tied_embeddings and first:
                self.head = None
            else:
                self.head = plan.head("head", STD)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        if self.head is None:  # tied: reuse the embedding matrix
            return self.plan.tied_logits(h, self.embed) if self.plan.tp > 1 else F.linear(
                h, self.embed.weight)
        return self.head(h)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens (first stage) or hidden states in; hidden states, or the summed token loss
        (last stage, when ``targets`` are given) out."""
        h = self.plan.enter_blocks(self.embed(x)) if self.first else x
        rope = L.rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)
        for block in self.layers.values():
            if self.plan.par.recompute == "full" and torch.is_grad_enabled():
                h = checkpoint(block, h, rope, use_reentrant=False)
            else:
                h = block(h, rope)
        if not self.last:
            return h
        logits = self.logits(self.plan.exit_blocks(h))
        if targets is None:
            return logits
        return self.plan.loss(logits, targets)


def build_model(cfg: ModelConfig, plan: Any, layer_ids: list[int] | None = None,
                first: bool = True, last: bool = True) -> Transformer:
    return Transformer(cfg, plan, layer_ids, first, last)
