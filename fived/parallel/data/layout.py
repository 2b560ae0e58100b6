"""The bucket layout and the build: which parameters share a flat buffer, in what order, and
filling each buffer with this rank's pieces (born sharded).

Order: runs of parameters in launch order — reverse registration order (≈ the order backward
produces their gradients) — each split by reduction group (``Placement.grad_group``: ``dense``
dp·ep·cp, ``expert`` dp·cp; hybrid sharding: their shard parts ``dense_shard``, ``expert_shard``,
``Grid.shard_group``), then cut into buckets of at most ``par.bucket_mb`` of gradient
(``buckets.split_buckets``, the ledger's cut). ZeRO-3 lays out per gather unit instead
(``zero3.UnitLayout``: one bucket per (unit, group), the last unit first, the root last).
With the fp8 parameter all-gather (``fived.ledger.params.fp8_gather``) each bucket is split
once more (``fp8_split``): its fp8 linears' weights first, then the rest, so the fp8 weights
are buckets of their own (``fp8.Fp8Gather`` gathers those in e4m3).
A parameter summed over the embedding group (the embedding's copies on the first and the last
pipeline stage) is a bucket of its own (``alone``).

Build (per bucket): a zeroed flat buffer of ``padded`` elements in the compute dtype on the
rank's device; each parameter still on the meta device gets its slot filled from ``source``
(``fived.model.init.InitSource``: drawn from (seed, name); ``fived.checkpoint.hf.HFSource``:
read from safetensors) — only this rank's tp/ep piece — and is swapped off meta
(``torch.utils.swap_tensors``) to a view of the buffer; a parameter that has values is copied
in. The owned shard is ``[lo, hi)`` of the buffer (a view; ZeRO-3: a copy, the full buffer is
freed at once, so the build's transient is one bucket; ZeRO-1/2's fp8-gathered buckets: a copy
too, the compute-dtype buffer freed at once — the whole weight lives on as its fp8 cast —,
so no stale piece of it can be read). Then the stage's gradient storage
(``build_grads``, the engine's seam).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...ledger.params import fp8_gather, fp8_weight
from ..placement import Placement
from .buckets import Bucket, Named, by_group, split_buckets
from .fp8 import Fp8Gather


def fp8_split(run: list[Named], par: Any) -> list[list[Named]]:
    """``run`` whole; with the fp8 gather (``fived.ledger.params.fp8_gather``) its fp8 linears'
    weights (``fp8_weight``) first, then the rest, empty runs left out
    (``fived.ledger.memory._bucket_members`` cuts alike)."""
    if not fp8_gather(par):
        return [run]
    f8 = [(n, p) for n, p in run if fp8_weight(n)]
    return [r for r in (f8, [(n, p) for n, p in run if not fp8_weight(n)]) if r]


def alone(named: list[Named], placements: dict[str, Placement]) -> list[list[Named]]:
    """``named`` cut so that every parameter summed over the embedding group (``embed`` in its
    ``grad_sum``) is a run of its own: its bucket, and so its shards, are laid out alike on the
    first and the last pipeline stage, and the reduced shards are summed over the group."""
    out: list[list[Named]] = [[]]
    for item in named:
        if "embed" in placements[item[0]].grad_sum:
            out += [[item], []]
        else:
            out[-1].append(item)
    return [r for r in out if r]


class Layout:
    """Size-capped buckets in reverse registration order (ZeRO-0/1/2)."""

    def __init__(self, grid: Any, par: Any, placements: dict[str, Placement], policy: Any,
                 device: torch.device, source: Any, sharding: Any, align_rows: bool):
        self.grid, self.par, self.placements, self.policy = grid, par, placements, policy
        self.device, self.source, self.sharding = device, source, sharding
        self.align_rows = align_rows

    def runs(self, named: list[Named], units: list[nn.Module] | None
             ) -> list[tuple[int, list[Named]]]:
        """(unit, parameters) runs in launch order; each is split by group, then ``split``."""
        return [(-1, list(reversed(named)))]

    def split(self, run: list[Named]) -> list[list[Named]]:
        """Runs of at most ``bucket_mb`` of gradient, each then ``fp8_split``."""
        esize = torch.empty((), dtype=self.policy.grad).element_size()
        return [r for piece in split_buckets(run, max(1, int(self.par.bucket_mb * 2**20 / esize)))
                for r in fp8_split(piece, self.par)]

    def build(self, named: list[Named], units: list[nn.Module] | None,
              build_grads: Callable[[Bucket], None]) -> list[Bucket]:
        """Every bucket, laid out, then filled and given its gradient storage."""
        tp = self.grid.degrees["tp"]
        buckets: list[Bucket] = []
        for unit, run in self.runs(named, units):
            for name, items in by_group(run, self.placements).items():
                # hybrid sharding: ZeRO over the group's shard part (dense_shard, expert_shard)
                group = self.grid[self.grid.shard_group(name)]
                for piece in [p for run in alone(items, self.placements)
                              for p in self.split(run)]:
                    buckets.append(Bucket(piece, [self.placements[n] for n, _ in piece], name,
                                          group, self.sharding.shard_count(group),
                                          len(buckets), tp, unit, align_rows=self.align_rows))
        for b in buckets:
            self.fill(b)
            build_grads(b)
        return buckets

    def fill(self, b: Bucket) -> None:
        """Flat parameters (``p.data`` become views of ``b.param_full``) and the owned shard."""
        flat = torch.zeros(b.padded, dtype=self.policy.compute, device=self.device)
        with torch.no_grad():
            for j, p in enumerate(b.params):
                view = b.view(flat, j)
                if p.is_meta and not flat.is_meta:  # born sharded: only this rank's piece
                    if self.source is not None:
                        pl = self.placements[b.names[j]]
                        self.source.fill(view, pl.name, pl.shape, pl.dim, pl.parts, pl.index)
                    # the module keeps its Parameter object, moved off meta (``.data`` cannot
                    # change the device); then, as for any parameter, a view of the buffer
                    torch.utils.swap_tensors(p, nn.Parameter(view.new_empty(0), p.requires_grad))
                else:
                    view.copy_(p.detach())
                p.data = view
        b.param_full = flat
        b.param_shard = self.own_shard(flat, b)
        if self.fp8_held(b):  # the whole weights live on as their fp8 cast (``Zero1``)
            flat.untyped_storage().resize_(0)

    def fp8_held(self, b: Bucket) -> bool:
        """ZeRO-1/2 with the fp8 gather: bucket ``b`` is gathered in e4m3 (``Fp8Gather``), its
        compute-dtype buffer freed after the build (ZeRO-3's ``UnitLayout`` frees every one)."""
        return 0 < self.par.zero < 3 and fp8_gather(self.par) and Fp8Gather.gathers(b)

    def own_shard(self, flat: torch.Tensor, b: Bucket) -> torch.Tensor:
        """This rank's slice of a bucket's flat parameters: a view (the full buffer stays), a
        copy where the full buffer is freed (``fp8_held``)."""
        return flat[b.lo:b.hi].clone() if self.fp8_held(b) else flat[b.lo:b.hi]
