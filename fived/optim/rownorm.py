"""RowNorm: a row-local optimizer — each row's update depends only on that row.

    m ← β₁ m + (1−β₁) g                        (fp32, one moment: 4 bytes per element)
    θ_i ← θ_i − lr · ( m_i / (rms(m_i) + ε) + λ θ_i ),   rms(m_i)² = Σ_j m_ij² / C

for every row i of every matrix (C = the global row length; a 1-D parameter is one row). The
update has RMS 1 in every row (a per-row normalised momentum, the row-wise relative of
normalised SGD / Lion's sign); no bias correction is needed since the row normalisation
cancels it.

Sharding: a tp cut along rows (column-parallel q/k/v/gate/up, the vocab-parallel embedding and
head: ``dim 0``) leaves every row whole — free. A cut inside rows (row-parallel o/down:
``dim 1``) and ZeRO's flat shards (cut at arbitrary elements) need Σ_j m_ij² completed: one
all-reduce of a row-statistics buffer (``pieces.reduce_stats``; 4 bytes per row). With
``--zero-align rows`` the ZeRO shards start and end on whole rows and the ZeRO part of that
reduction disappears (the padding it costs is reported in ``memory()["padding"]``).
"""

from __future__ import annotations

import torch

from .pieces import reduce_stats
from .sharded import ShardedOptimizer


class RowNorm(ShardedOptimizer):
    name = "rownorm"
    flat_names = ("m",)

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.m = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]

    def step(self, grads: list[torch.Tensor], lr: float) -> None:
        self.t += 1
        for m, g in zip(self.m, grads):
            m.mul_(self.beta1).add_(g.float(), alpha=1 - self.beta1)
        entries = [(b, p, "row", p.row_sums(self.m[b.index][p.lo:p.hi].square()))
                   for b in self.buckets for p in b.pieces]
        stats = reduce_stats(entries, self.grid, zero=not self.aligned_rows)
        for (b, p, _, _), s in zip(entries, stats):
            if not p.owned:
                continue
            m = self.m[b.index][p.lo:p.hi]
            rms = (s / p.gshape[1]).sqrt_()
            theta = self.params[b.index][p.lo:p.hi]
            self.decay(theta, lr)
            theta.addcdiv_(m, rms[p.rows_of()].add_(self.eps), value=-lr)

    def flat_state(self, i: int) -> list[torch.Tensor]:
        return [self.m[i]]
