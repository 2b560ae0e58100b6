"""Muon (Jordan et al. 2024): momentum, orthogonalised per whole matrix by a Newton–Schulz
iteration, for the hidden matrices; AdamW for the rest (embedding, head, norms — Muon's
practice).

    m ← μ m + g,   G = g + μ m (Nesterov)          μ = 0.95
    O = NS₅(G)     X₀ = G/‖G‖_F,  X ← a X + (b A + c A²) X,  A = X Xᵀ   (a, b, c) =
                   (3.4445, −4.7750, 2.0315), 5 steps, on the wide orientation
    θ ← θ − lr · ( 0.2 √max(R, C) · O + λ θ )     (the 0.2√max scale of Liu et al. 2025 makes the
                                                    update RMS AdamW's, so one lr serves both)

State: m only (4 bytes per element) for the matrices, AdamW's m and v (8 bytes) elsewhere.

Sharding: NS₅ needs the whole matrix. Each bucket holding a Muon matrix all-gathers its G
shards over the ZeRO group ((N−1)/N · padded bucket · 4 bytes), and a tp-cut matrix is
all-gathered over tp ((tp−1)/tp · matrix · 4 bytes); every rank then runs NS₅ on every whole
matrix of its buckets and keeps its own elements (the iteration is repeated, not
distributed: compute traded for simplicity).
"""

from __future__ import annotations

import math

import torch

from ..comm import ops
from .pieces import Piece
from .sharded import ShardedOptimizer, key

MOMENTUM = 0.95
NS_COEFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    a, b, c = NS_COEFS
    x = g.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def is_muon(name: str, ndim: int) -> bool:
    """Hidden matrices: 2-D and neither the embedding nor the head."""
    return ndim == 2 and not name.startswith(("embed_tokens", "lm_head"))


class Muon(ShardedOptimizer):
    name = "muon"
    flat_names = ("m",)
    state_kinds = {"v": "owned"}

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.m = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self.v = {key(b, p): torch.zeros(p.owned) for b in self.buckets for p in b.pieces
                  if p.owned and not self.muon(p)}

    @staticmethod
    def muon(p: Piece) -> bool:
        return is_muon(p.name, p.ndim)

    def step(self, grads: list[torch.Tensor], lr: float) -> None:
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        c1, c2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        geff = {}
        for b in self.buckets:
            if any(self.muon(p) for p in b.pieces):
                geff[b.index] = torch.zeros_like(self.m[b.index])
            for p in b.pieces:
                if not p.owned:
                    continue
                g = grads[b.index][p.lo:p.hi].float()
                m = self.m[b.index][p.lo:p.hi]
                theta = self.params[b.index][p.lo:p.hi]
                if self.muon(p):
                    m.mul_(MOMENTUM).add_(g)
                    geff[b.index][p.lo:p.hi] = g + MOMENTUM * m
                    continue
                v = self.v[key(b, p)]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                self.decay(theta, lr)
                theta.addcdiv_(m, (v / c2).sqrt_().add_(self.eps), value=-lr / c1)
        tp = self.grid["tp"]
        for b in self.buckets:
            if b.index not in geff:
                continue
            full = torch.empty(b.padded) if b.sharded else geff[b.index]
            if b.sharded:
                ops.all_gather_into(full, geff[b.index], b.group)
            for p in b.pieces:
                if not self.muon(p):
                    continue
                G = full[p.off:p.off + p.numel].view(p.shape)
                if p.parts > 1:
                    chunks = ops.all_gather(G, tp, dim=p.dim).chunk(tp.size, dim=p.dim)
                    G = torch.cat(chunks[::tp.size // p.parts], dim=p.dim)
                upd = newton_schulz(G) * (0.2 * math.sqrt(max(p.gshape)))
                if p.parts > 1:
                    upd = upd.chunk(p.parts, dim=p.dim)[p.index]
                if p.owned:
                    theta = self.params[b.index][p.lo:p.hi]
                    self.decay(theta, lr)
                    theta.add_(upd.reshape(-1)[p.start:p.end], alpha=-lr)

    def flat_state(self, i: int) -> list[torch.Tensor]:
        return [self.m[i]]

    def extra_state(self) -> dict[str, torch.Tensor]:
        return {f"v.{k}": t for k, t in self.v.items()}
