"""ZeRO-3's fp8 parameter all-gather: the fp8 linears' weights travel as e4m3 with their scales.

Under ``--zero 3 --fp8 tensorwise`` (``fived.ledger.params.fp8_gather``; off with
``--no-fp8-gather``) each gather unit's fp8 linear weights (``FP8_LINEARS``) are a bucket of
their own per reduction group (``zero3.UnitLayout``), and that bucket is gathered in fp8
(torchtitan's float8 all-gather for FSDP2): for each weight W of the bucket, with the shard
holding a piece W_r of it on rank r of the shard group G,

    amax  = max over G (and, for a tp-cut weight, over tp) of max|W_r|   one all-reduce per
                                                                         bucket, per step
    s     = 2^⌈log₂(amax / 448)⌉          (``fived.model.fp8.scale_of``, power of 2)
    q_r   = e4m3(clamp(W_r / s, ±448))    the shard cast, element by element
    q     = all_gather(q_r)               1 byte per element instead of 2 (bf16) or 4

so q and s are bit for bit what one rank's cast of the whole W gives (``fived.model.fp8.cast``
of a tensorwise weight: the same amax, the same scale, the same elementwise rounding), and the
fp8 linear uses them (``fived.model.fp8.provide``) instead of casting W: W itself is never
materialised in the compute dtype, the gathered unit holds 1 byte per fp8-weight element. The
scales are taken once per optimizer step — at the first gather after the engine's
``zero_grad``, its optimizer step or a ``publish_params`` (``stale``) — and reused by every
later gather of the step (forward and backward, every micro-batch), as torchtitan precomputes
them after the step.

Traffic per step and bucket of P padded elements and w weights, bytes sent per rank:

    all_gather(1·P) per gather (was param_bytes·P) + all_reduce(4·w) over G (+ over tp)

Rowwise and blockwise keep the compute-dtype gather: rowwise casts W with one scale per row
for the forward and per column for the dgrad (two casts of W, which one fp8 copy cannot
serve; torchtitan runs rowwise with a bf16 gather too); blockwise's 128×128 blocks would need
every block's amax reduced across the flat shards that cut it (docs/numerics.md).
"""

from __future__ import annotations

from typing import Any

import torch

from ...comm import ops
from ...ledger.params import fp8_gather, fp8_weight
from ...model import fp8 as fp8_mod
from .buckets import Bucket


class Fp8Gather:
    """The fp8 gather of the buckets that hold only fp8 weights (``of``: None when off)."""

    def __init__(self, buckets: list[Bucket], placements: dict[str, Any], grid: Any):
        self.buckets = {b.index for b in buckets
                        if b.shards > 1 and all(fp8_weight(n) for n in b.names)}
        tp = grid["tp"] if grid.degrees.get("tp", 1) > 1 else None
        # a tp-cut weight's amax is reduced over tp too (the linear's cut takes it there)
        self.tp = {b.index: (tp if tp is not None and any(
            placements[n].parts > 1 for n in b.names) else None) for b in buckets}
        self.scales: dict[int, torch.Tensor] = {}  # index -> s, until ``stale``
        # index -> the gathered e4m3 bytes: one flat buffer per bucket, its storage resized to
        # the padded length for a gather and to 0 at the free (as the compute-dtype buckets'),
        # so nothing that still refers to it (a collective's work, a view) keeps the bytes
        self.full = {b.index: torch.empty(b.padded, dtype=torch.uint8,
                                          device=b.param_shard.device)
                     for b in buckets if b.index in self.buckets}
        for t in self.full.values():
            t.untyped_storage().resize_(0)

    @classmethod
    def of(cls, buckets: list[Bucket], placements: dict[str, Any], grid: Any, par: Any
           ) -> Fp8Gather | None:
        return cls(buckets, placements, grid) if fp8_gather(par) else None

    def owns(self, b: Bucket) -> bool:
        return b.index in self.buckets

    def nbytes(self, b: Bucket) -> int:
        """The gathered bytes (one per padded element; the scales, w floats, are kept per step)."""
        return b.padded

    def _pieces(self, b: Bucket) -> list[tuple[int, int, int]]:
        """(weight, start, end) of each weight's piece of the owned range, shard-relative."""
        out = []
        for j, (p, off) in enumerate(zip(b.params, b.offsets)):
            lo, hi = max(off, b.lo), min(off + p.numel(), b.hi)
            if lo < hi:
                out.append((j, lo - b.lo, hi - b.lo))
        return out

    def stale(self) -> None:
        """The shards may have changed (a step began, the optimizer stepped, a checkpoint was
        published): the next gather of each bucket takes its scales again."""
        self.scales.clear()

    def scale(self, b: Bucket) -> torch.Tensor:
        """Each weight's decode scale (w,), fp32: the amax max-reduced over the shards (and tp)
        at the first call since ``stale``, else that call's."""
        cached = self.scales.get(b.index)
        if cached is not None:
            return cached
        amax = torch.zeros(len(b.params), dtype=torch.float32, device=b.param_shard.device)
        for j, lo, hi in self._pieces(b):
            amax[j] = b.param_shard[lo:hi].detach().abs().amax().float()
        ops.all_reduce(amax, b.group, op="max")
        if self.tp is not None and self.tp.get(b.index) is not None:
            ops.all_reduce(amax, self.tp[b.index], op="max")
        s = fp8_mod.scale_of(amax, fp8_mod.E4M3, pow2=True)
        self.scales[b.index] = s
        return s

    def start(self, b: Bucket) -> Any:
        """Cast the shard, start its all-gather (async), provide every weight's fp8 view."""
        s = self.scale(b)
        fmax = fp8_mod.FMAX[fp8_mod.E4M3]
        shard = torch.zeros(b.shard_numel, dtype=fp8_mod.E4M3, device=b.param_shard.device)
        for j, lo, hi in self._pieces(b):
            # W / s in W's dtype: s is a power of 2, so exact (bf16 has fp32's exponent range),
            # and the one rounding is the e4m3 cast's, as in ``fp8_mod.quantize``; no fp32 copy
            shard[lo:hi].copy_((b.param_shard[lo:hi].detach() / s[j]).clamp_(-fmax, fmax))
        full = self.full[b.index]
        full.untyped_storage().resize_(b.padded)
        data = full.view(fp8_mod.E4M3)
        for j, (p, off) in enumerate(zip(b.params, b.offsets)):
            q = fp8_mod.Fp8(data[off:off + p.numel()].view(p.shape), s[j].view(1, 1),
                            (fp8_mod.ALL, fp8_mod.ALL))
            fp8_mod.provide(p, q)
        return ops.all_gather_into(full, shard.view(torch.uint8), b.group, async_op=True)

    def free(self, b: Bucket) -> None:
        for p in b.params:
            fp8_mod.provide(p, None)
        self.full[b.index].untyped_storage().resize_(0)
