"""Flat gradient buckets: a contiguous run of parameters reduced over one group, on one buffer.

A bucket of ``numel`` elements sharded over N members (ZeRO; N = 1 for DDP) is padded so every
member owns an equal contiguous shard:

    padded = ⌈numel / N⌉ · N        S = padded / N        member i owns [i·S, (i+1)·S)
    pad    = padded − numel          (< N elements; reported as ``memory()["padding"]``)

With ``align_rows`` (``--zero-align rows``) S is the smallest shard length ≥ ⌈numel/N⌉ whose
boundaries i·S all fall on whole rows of the parameter they cut (a 1-D parameter is one row;
``fived.ledger.optimizers.aligned_shard_len``): a row-local optimizer then finds every row on one
member; the extra padding N·S − numel is the price.

``split_buckets`` cuts a list of parameters (already in launch order) into runs of at most
``cap`` elements (``par.bucket_mb`` of gradient); a parameter is never split across buckets.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...ledger.memory import split_sizes
from ...ledger.optimizers import aligned_shard_len
from ..placement import Placement

Named = tuple[str, nn.Parameter]


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class Bucket:
    """``named`` parameters reduced over ``group`` (``group_name``: dense | expert), flat, with
    ``shards`` equal shards; ``tp`` sets the norm weights of the placements."""

    def __init__(self, named: list[Named], placements: list[Placement], group_name: str,
                 group: Any, shards: int, index: int, tp: int, unit: int = -1,
                 align_rows: bool = False):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.group_name, self.group, self.index, self.unit = group_name, group, index, unit
        self.grad_sum = [pl.grad_sum for pl in placements]  # partial over these groups first
        self.offsets: list[int] = []
        off = 0
        for p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        self.shards = shards
        self.padded = -(-off // shards) * shards
        if align_rows and shards > 1:
            rows = [p.shape[-1] if p.dim() > 1 else p.numel() for p in self.params]
            self.padded = aligned_shard_len([p.numel() for p in self.params], rows,
                                            shards) * shards
        self.pad = self.padded - off
        self.shard_numel = self.padded // shards
        member = group.rank if shards > 1 else 0
        self.lo, self.hi = member * self.shard_numel, (member + 1) * self.shard_numel
        self.ready = 0  # gradients produced in this (last micro-batch's) backward
        self.launched = False
        self.handle: Any = None
        # tensors, filled in by the engine
        self.param_full: torch.Tensor | None = None   # compute dtype, padded
        self.param_shard: torch.Tensor | None = None  # compute dtype, own shard
        self.master: torch.Tensor | None = None       # fp32 owned elements (may alias params)
        self.comp: torch.Tensor | None = None         # --master-weights kahan: bf16 compensation
        self.grad: torch.Tensor | None = None         # full gradient buffer (padded)
        self.grad_shard: torch.Tensor | None = None   # owned gradient elements
        self.segments = self.owned_segments([pl.norm_weight(tp) for pl in placements])

    def owned_segments(self, weights: list[float]) -> list[tuple[int, int, float]]:
        """(start, end, norm weight) of each parameter's part of the owned range, shard-relative."""
        segs = []
        for p, off, w in zip(self.params, self.offsets, weights):
            a, b = max(off, self.lo), min(off + p.numel(), self.hi)
            if a < b:
                segs.append((a - self.lo, b - self.lo, w))
        return segs

    def view(self, flat: torch.Tensor, j: int) -> torch.Tensor:
        p = self.params[j]
        return flat[self.offsets[j]:self.offsets[j] + p.numel()].view_as(p)

    def weighted_pieces(self) -> list[tuple[torch.Tensor, float]]:
        """The owned gradient, cut per parameter, with each piece's norm weight."""
        return [(self.grad_shard[lo:hi], w) for lo, hi, w in self.segments]


def split_buckets(named: list[Named], cap_elems: int) -> list[list[Named]]:
    """Runs of at most ``cap_elems`` elements, cut as the ledger cuts them (``split_sizes``)."""
    out, start = [], 0
    for run in split_sizes([p.numel() for _, p in named], cap_elems):
        out.append(named[start:start + len(run)])
        start += len(run)
    return out


def by_group(named: list[Named], placements: dict[str, Placement]) -> dict[str, list[Named]]:
    """``named`` split by reduction group (``grad_group``), order kept, groups in order of their
    first parameter."""
    out: dict[str, list[Named]] = {}
    for item in named:
        out.setdefault(placements[item[0]].grad_group, []).append(item)
    return out
