"""Adafactor (Shazeer & Stern 2018): the second moment of a matrix kept as its row and column
sums, without momentum (β₁ = 0, the paper's setting).

    R_i ← β₂ R_i + (1−β₂) Σ_j (g_ij² + ε₁)        C_j ← β₂ C_j + (1−β₂) Σ_i (g_ij² + ε₁)
    v̂_ij = R_i C_j / Σ_i R_i / (1 − β₂ᵗ)
    θ ← θ − lr · ( g / (√v̂ + ε) + λ θ )

A 1-D parameter of n elements is the (1, n) matrix, for which v̂ is exactly the unfactored
second moment. State: (R + C)·4 bytes per matrix (the tp-local rows and columns), the same on
every member of a ZeRO group (a few kB) — against Adam's 8 bytes per element. Not done here:
Adafactor's update clipping and relative step size (the run's schedule gives lr).

Sharding: a shard that cuts rows or columns holds partial sums. ZeRO's flat shards cut both:
the row and column sums are all-reduced over the ZeRO group; a tp cut along rows (dim 0)
splits every column sum, along columns (dim 1) every row sum: those are all-reduced over tp
(``pieces.reduce_stats``; 4 bytes per row and column). Σ_i R_i is taken from whichever of R, C
is complete on this rank (Σ R = Σ C).
"""

from __future__ import annotations

import torch

from .pieces import reduce_stats
from .sharded import ShardedOptimizer, key

EPS1 = 1e-30


class Adafactor(ShardedOptimizer):
    name = "adafactor"
    state_kinds = {"R": "rows", "C": "cols"}

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.R = {key(b, p): torch.zeros(p.shape[0]) for b in self.buckets for p in b.pieces}
        self.C = {key(b, p): torch.zeros(p.shape[1]) for b in self.buckets for p in b.pieces}

    def step(self, grads: list[torch.Tensor], lr: float) -> None:
        self.t += 1
        b2 = self.beta2
        entries = []
        for b in self.buckets:
            for p in b.pieces:
                g2 = grads[b.index][p.lo:p.hi].float().square().add_(EPS1)
                entries += [(b, p, "row", p.row_sums(g2)), (b, p, "col", p.col_sums(g2))]
        stats = reduce_stats(entries, self.grid)
        corr = 1 - b2 ** self.t
        for k in range(0, len(entries), 2):
            b, p = entries[k][0], entries[k][1]
            R, C = self.R[key(b, p)], self.C[key(b, p)]
            R.mul_(b2).add_(stats[k], alpha=1 - b2)
            C.mul_(b2).add_(stats[k + 1], alpha=1 - b2)
            if not p.owned:
                continue
            total = C.sum() if (p.parts > 1 and p.dim == 0) else R.sum()
            v = R[p.rows_of()] * C[p.cols_of()] / (total * corr)
            g = grads[b.index][p.lo:p.hi].float()
            theta = self.params[b.index][p.lo:p.hi]
            self.decay(theta, lr)
            theta.addcdiv_(g, v.sqrt_().add_(self.eps), value=-lr)

    def extra_state(self) -> dict[str, torch.Tensor]:
        out = {f"R.{k}": t for k, t in self.R.items()}
        out.update({f"C.{k}": t for k, t in self.C.items()})
        return out
