"""The global gradient norm and clipping by it.

Every element of the one-rank model's gradient is counted once, wherever it lives:

    ‖g‖² = Σ_pieces w · Σ g²       w = parts / tp (``Placement.norm_weight``: a piece held by
                                   tp / parts tensor-parallel ranks counts 1/(tp/parts) on each)

summed over the ZeRO shards of a data-parallel group (each rank owns disjoint elements), then
expert pieces over ep, then everything over tp and pp. Clipping (the rule of
``torch.nn.utils.clip_grad_norm_``, applied only when it shrinks):

    g ← g · max_norm / (‖g‖ + 1e−6)        when max_norm > 0 and ‖g‖ > max_norm

Traffic: all-reduces of one float64 scalar per group, under the group name ``metrics`` (not
model traffic: the ledger does not count them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import torch

from ..comm import ops

EPS = 1e-6


SQ_CHUNK = 1 << 18  # elements per float64 partial sum: the norm's transient stays 2 MiB


def accumulate_sq(acc: torch.Tensor, pieces: Iterable[tuple[torch.Tensor, float]]) -> torch.Tensor:
    """``acc += w · Σ g²`` for every (g, w), in float64, in order, in chunks of ``SQ_CHUNK``
    elements (a float64 copy of a whole gradient would be twice its size); returns ``acc``."""
    for g, w in pieces:
        flat = g.reshape(-1)
        s = None
        for c in (flat,) if flat.numel() <= SQ_CHUNK else flat.split(SQ_CHUNK):
            d = c.double()
            s = torch.dot(d, d) if s is None else s.add_(torch.dot(d, d))
            del d  # one float64 chunk alive at a time (the ledger's clip transient)
        if s is not None:  # (0 + x and x · 1 are x: the same bits as a zero start, w = 1)
            acc += s if w == 1.0 else s * w
    return acc


def model_parallel_sq(dense: torch.Tensor, expert: torch.Tensor, grid: Any) -> torch.Tensor:
    """The global ‖g‖² from one rank's dense and expert sums (already summed over their ZeRO
    shards): experts over ep, then both over tp and pp (metrics-only collectives)."""
    metrics = {n: replace(grid[n], name="metrics") for n in ("ep", "tp", "pp")}
    ops.all_reduce(expert, metrics["ep"])
    total = dense + expert
    ops.all_reduce(total, metrics["tp"])
    ops.all_reduce(total, metrics["pp"])
    return total


def clip_coef(norm: float, max_norm: float) -> float | None:
    """The factor that brings ``norm`` down to ``max_norm``, or None when no clipping applies."""
    if max_norm > 0 and norm > max_norm:
        return max_norm / (norm + EPS)
    return None


def scale_(tensors: Iterable[torch.Tensor], factor: float) -> None:
    for t in tensors:
        t.mul_(factor)


def clip_(tensors: list[torch.Tensor], max_norm: float) -> float:
    """One process, whole tensors: clip ``tensors`` in place by their joint norm; the norm."""
    norm = float(accumulate_sq(torch.zeros((), dtype=torch.float64),
                               ((t, 1.0) for t in tensors)).sqrt())
    coef = clip_coef(norm, max_norm)
    if coef is not None:
        scale_(tensors, coef)
    return norm
