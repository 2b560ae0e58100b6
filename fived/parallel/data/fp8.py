"""ZeRO's fp8 parameter all-gather: the fp8 linears' weights travel as e4m3 with their scales.

Under ``--zero 3 --fp8 R`` (``fived.ledger.params.fp8_gather``: tensorwise and blockwise, and
rowwise without pp; off with ``--no-fp8-gather``) each gather unit's fp8 linear weights
(``FP8_LINEARS``) are a bucket of their own per reduction group (``zero3.UnitLayout``), and that
bucket is gathered in fp8 (torchtitan's float8 all-gather for FSDP2). The shards are flat: a
shard boundary falls anywhere in a weight W (N×K, row-major), cutting rows and 128×128 blocks,
so no rank can take a tile's amax alone. Each rank takes the amax of every tile over the piece
W_r it holds (zero where it holds none of the tile), then, once per optimizer step and bucket,

    amax  = max over G of amax_r             one all-reduce of the bucket's tile amaxes over
                                             the shard group G (rowwise tp: and of the tiles
                                             that span the tp cut, over tp)
    s     = 2^⌈log₂(amax / 448)⌉             (``fived.model.fp8.scale_of``), per tile
    q_r   = e4m3(clamp(W_r / s, ±448))       the shard cast element by element, each with its
                                             tile's s (a power of 2: exact in W's dtype)
    q     = all_gather(q_r)                  1 byte per element instead of 2 (bf16) or 4

with the tiles of each recipe's weight operand (``fived.model.fp8``; T = 128):

    recipe       tiles of W (N×K)                 amaxes per weight   casts of W
    tensorwise   W whole                          1                   1 (serves Wᵀ and W)
    blockwise    T×T blocks                       ⌈N/T⌉·⌈K/T⌉         1 (Wᵀ's blocks are W's)
    rowwise      rows (forward, Wᵀ's columns)     N + K               2: the forward's per row,
                 and columns (dgrad)                                  the dgrad's per column

so q and s are bit for bit what one rank's cast of the whole W gives (the same tiles, the same
amax — a maximum, exact in any order —, the same scale, the same elementwise rounding), and the
fp8 linear uses them (``fived.model.fp8.provide``) instead of casting W: W itself is never
materialised in the compute dtype. Rowwise's two casts are two different roundings of W, so
each gather carries the one its pass needs: a unit's forward gather the per-row cast, its
backward gather the per-column cast (both under ``--recompute full``, whose backward reruns
the forward; the root, gathered once for both, would carry both). Under tp the rowwise
amaxes that span the cut (a column layer's per-column, a row layer's per-row: the K or N side
that is the hidden size) are max-reduced over tp as well; tensorwise reduces its one amax per
weight over tp; blockwise none (its tiles stop at the cut). The scales are taken once per
optimizer step — at the first gather after the engine's ``zero_grad``, its optimizer step or a
``publish_params`` (``stale``) — and reused by every later gather of the step (forward and
backward, every micro-batch), as torchtitan precomputes them after the step.

Traffic per step and bucket of P padded elements, A amaxes (the table's column, summed over
its weights), bytes sent per rank:

    all_gather(1·P) per gather and cast (was param_bytes·P) + all_reduce(4·A) over G
    (+ tp: tensorwise all_reduce(4·w) of its w weights, rowwise all_reduce(4·h·w))

and held: 1·P per gathered cast while the unit is gathered, 4·A from the bucket's first gather
of the step to the step's end (the scales).

ZeRO-1/2 (``zero12.Zero1``; tensorwise and blockwise) use the same gather once per optimizer
step, after it (and after the build and ``publish_params``): ``stale``, then ``start`` for every
owned bucket, and the casts are kept (never ``free``d) until the next step's gather overwrites
them in place: 1·P + 4·A of parameter state (``held``), beside the rank's compute-dtype shard.
``withdraw`` takes the provided casts back when the engine closes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ...comm import ops
from ...ledger.params import fp8_gather, fp8_weight
from ...model import fp8 as fp8_mod
from .buckets import Bucket

TILE = fp8_mod.TILE
ROLES = ("w_fwd", "w_dgrad")  # the weight's operands (fived.model.fp8): Wᵀ forward, W dgrad


def _rects(start: int, end: int, k: int) -> list[tuple[int, int, int, int, int]]:
    """The flat range [start, end) of a row-major (·, k) matrix as rectangles (row, column,
    rows, columns, offset into the range): a partial first row, whole rows, a partial last."""
    out, i = [], start
    while i < end:
        r, c = divmod(i, k)
        if c or end - i < k:
            n = min(k - c, end - i)
            out.append((r, c, 1, n, i - start))
            i += n
        else:
            rows = (end - i) // k
            out.append((r, 0, rows, k, i - start))
            i += rows * k
    return out


def amax_count(recipe: str, shape: tuple[int, ...]) -> int:
    """The tile amaxes of one weight of ``shape`` (N, K) (the module docstring's table)."""
    n, k = shape
    if recipe == "rowwise":
        return n + k
    if recipe == "blockwise":
        return -(-n // TILE) * -(-k // TILE)
    return 1


class Fp8Gather:
    """The fp8 gather of the buckets that hold only fp8 weights (``of``: None when off)."""

    def __init__(self, buckets: list[Bucket], placements: dict[str, Any], grid: Any,
                 recipe: str = "tensorwise", recompute: bool = False, buffers: Any = None):
        if recipe not in fp8_mod.RECIPES:
            raise ValueError(f"fp8 recipe {recipe!r}")
        self.recipe, self.recompute = recipe, recompute
        # the scales, 4 bytes per tile amax, held from a bucket's first gather of the step to
        # ``stale`` (``accounting.Buffers``: the engine's transient bytes)
        self.buffers, self.held_scales = buffers, 0
        self.buckets = {b.index for b in buckets if self.gathers(b)}
        tp = grid["tp"] if grid.degrees.get("tp", 1) > 1 else None
        # a tp-cut weight's amax is reduced over tp too (the linear's cut takes it there);
        # blockwise tiles stop at the cut
        self.tp = {b.index: (tp if tp is not None and recipe != "blockwise" and any(
            placements[n].parts > 1 for n in b.names) else None) for b in buckets}
        # rowwise over tp: the amax of W's rows (a row layer: K cut) or of its columns
        self.row_cut = {b.index: [placements[n].parts > 1 and placements[n].dim == 1
                                  for n in b.names] for b in buckets}
        self.scales: dict[int, list[torch.Tensor]] = {}  # index -> each weight's s, until stale
        self.scale_flat: dict[int, torch.Tensor] = {}  # index -> its weights' s, one fp32 tensor
        # (index, cast) -> the gathered e4m3 bytes: one flat buffer per bucket and cast, its
        # storage resized to the padded length for a gather and to 0 at the free (as the
        # compute-dtype buckets'), so nothing that still refers to it keeps the bytes
        casts = ROLES if recipe == "rowwise" else ("w",)
        self.full = {(b.index, c): torch.empty(b.padded, dtype=torch.uint8,
                                               device=b.param_shard.device)
                     for b in buckets if b.index in self.buckets for c in casts}
        for t in self.full.values():
            t.untyped_storage().resize_(0)
        self.gathered: dict[int, tuple[str, ...]] = {}  # index -> the casts gathered now
        self.owned = [b for b in buckets if b.index in self.buckets]

    @classmethod
    def of(cls, buckets: list[Bucket], placements: dict[str, Any], grid: Any, par: Any,
           buffers: Any = None) -> Fp8Gather | None:
        return cls(buckets, placements, grid, par.fp8, par.recompute == "full",
                   buffers) if fp8_gather(par) else None

    @staticmethod
    def gathers(b: Bucket) -> bool:
        """Whether a bucket is gathered in fp8 when the gather is on: sharded (N > 1), holding
        fp8 linears' weights only (``fived.ledger.params.fp8_weight``)."""
        return b.shards > 1 and all(fp8_weight(n) for n in b.names)

    def owns(self, b: Bucket) -> bool:
        return b.index in self.buckets

    def held(self, b: Bucket) -> list[torch.Tensor]:
        """The tensors that hold bucket ``b``'s gathered weights now: its e4m3 casts (uint8,
        ``padded`` elements each), then its scales (fp32, one per tile amax); empty when not
        gathered. ZeRO-1/2 keep them between steps: part of the parameter state."""
        if b.index not in self.gathered:
            return []
        out = [self.full[(b.index, c)] for c in self.gathered[b.index]]
        return out + ([self.scale_flat[b.index]] if b.index in self.scale_flat else [])

    def withdraw(self) -> None:
        """Withdraw every weight this gather provided (the engine is closed: a later model
        whose parameter reuses an id must not find these casts)."""
        for b in self.owned:
            for p in b.params:
                fp8_mod.provide(p, None)

    def casts(self, roles: tuple[str, ...]) -> tuple[str, ...]:
        """The casts a gather for the operands ``roles`` carries (tensorwise, blockwise: the one
        cast, whatever the pass)."""
        return tuple(r for r in ROLES if r in roles) if self.recipe == "rowwise" else ("w",)

    def nbytes(self, b: Bucket) -> int:
        """The gathered bytes now: one per padded element and cast (the scales, kept per step,
        are a few floats per weight)."""
        return b.padded * len(self.gathered.get(b.index, ()))

    def _pieces(self, b: Bucket) -> list[tuple[int, int, int]]:
        """(weight, start, end) of each weight's piece of the owned range, shard-relative."""
        out = []
        for j, (p, off) in enumerate(zip(b.params, b.offsets)):
            lo, hi = max(off, b.lo), min(off + p.numel(), b.hi)
            if lo < hi:
                out.append((j, lo - b.lo, hi - b.lo))
        return out

    def _rects_of(self, b: Bucket, j: int, lo: int, hi: int):
        """``_rects`` of weight j's piece at shard range [lo, hi), each with its shard slice as
        a (rows, columns) matrix."""
        start = b.lo + lo - b.offsets[j]
        src = b.param_shard[lo:hi].detach()
        for r, c, nr, nc, o in _rects(start, start + hi - lo, b.params[j].shape[1]):
            yield r, c, lo + o, src[o:o + nr * nc].view(nr, nc)

    def stale(self) -> None:
        """The shards may have changed (a step began, the optimizer stepped, a checkpoint was
        published): the next gather of each bucket takes its scales again."""
        self.scales.clear()
        if self.buffers is not None:
            self.buffers.release(self.held_scales)
        self.held_scales = 0

    def _piece_amax(self, seg: torch.Tensor, shape: torch.Size, r: int, c: int,
                    t: torch.Tensor) -> None:
        """Max the amaxes of the tiles the rectangle ``t`` (at row r, column c of W) meets
        into ``seg`` (this weight's amaxes, the table's layout)."""
        a = t.abs()
        if self.recipe == "tensorwise":
            torch.maximum(seg, a.amax().float(), out=seg)
        elif self.recipe == "rowwise":
            rows, cols = seg[:shape[0]], seg[shape[0]:]
            nr, nc = t.shape
            torch.maximum(rows[r:r + nr], a.amax(1).float(), out=rows[r:r + nr])
            torch.maximum(cols[c:c + nc], a.amax(0).float(), out=cols[c:c + nc])
        else:  # blockwise: the rows' 1×T column-tile amaxes, then maxed per block row
            blk = seg.view(-(-shape[0] // TILE), -(-shape[1] // TILE))
            tiles = fp8_mod.tile_amax(F.pad(a, (c % TILE, 0)), (1, TILE))  # (rows, tiles)
            c0 = c // TILE
            for br in range(r // TILE, (r + t.shape[0] - 1) // TILE + 1):
                a0, a1 = max(br * TILE, r) - r, min((br + 1) * TILE, r + t.shape[0]) - r
                dst = blk[br, c0:c0 + tiles.shape[1]]
                torch.maximum(dst, tiles[a0:a1].amax(0), out=dst)

    def scale(self, b: Bucket) -> list[torch.Tensor]:
        """Each weight's decode scales, fp32 (tensorwise (), rowwise (N + K,) — rows then
        columns —, blockwise (⌈N/T⌉, ⌈K/T⌉)): the tile amaxes max-reduced over the shards (and
        tp) at the first call since ``stale``, else that call's."""
        cached = self.scales.get(b.index)
        if cached is not None:
            return cached
        sizes = [amax_count(self.recipe, tuple(p.shape)) for p in b.params]
        amax = torch.zeros(sum(sizes), dtype=torch.float32, device=b.param_shard.device)
        segs = list(amax.split(sizes))
        for j, lo, hi in self._pieces(b):
            if self.recipe == "tensorwise":  # no rectangles: the piece's amax
                seg = segs[j]
                torch.maximum(seg, b.param_shard[lo:hi].detach().abs().amax().float(), out=seg)
                continue
            for r, c, _, t in self._rects_of(b, j, lo, hi):
                self._piece_amax(segs[j], b.params[j].shape, r, c, t)
        ops.all_reduce(amax, b.group, op="max")
        tp = self.tp.get(b.index)
        if tp is not None and self.recipe == "tensorwise":
            ops.all_reduce(amax, tp, op="max")
        elif tp is not None:  # rowwise: the amaxes that span the cut, one all-reduce
            cut = [s[:p.shape[0]] if rc else s[p.shape[0]:]
                   for s, p, rc in zip(segs, b.params, self.row_cut[b.index])]
            both = torch.cat(cut)
            ops.all_reduce(both, tp, op="max")
            for s, v in zip(cut, both.split([c.numel() for c in cut])):
                s.copy_(v)
        s = fp8_mod.scale_of(amax, fp8_mod.E4M3, pow2=True)
        out = list(s.split(sizes))
        if self.recipe == "blockwise":
            out = [v.view(-(-p.shape[0] // TILE), -(-p.shape[1] // TILE))
                   for v, p in zip(out, b.params)]
        self.scales[b.index] = out
        self.scale_flat[b.index] = s
        if self.buffers is not None:
            self.buffers.hold(4 * s.numel())
        self.held_scales += 4 * s.numel()
        return out

    def _cast_shard(self, b: Bucket, s: list[torch.Tensor], cast: str) -> torch.Tensor:
        """The shard cast to e4m3 with each element's tile scale (``cast``: rowwise ``w_fwd``
        per row, ``w_dgrad`` per column; ``w`` the one cast of the other recipes). W / s in W's
        dtype: s is a power of 2, so exact (bf16 has fp32's exponent range), and the one
        rounding is the e4m3 cast's, as in ``fp8_mod.quantize``; no fp32 copy."""
        fmax = fp8_mod.FMAX[fp8_mod.E4M3]
        shard = torch.zeros(b.shard_numel, dtype=fp8_mod.E4M3, device=b.param_shard.device)
        for j, lo, hi in self._pieces(b):
            dt = b.param_shard.dtype
            if self.recipe == "tensorwise":
                shard[lo:hi].copy_((b.param_shard[lo:hi].detach() / s[j].to(dt))
                                   .clamp_(-fmax, fmax))
                continue
            n = b.params[j].shape[0]
            for r, c, at, t in self._rects_of(b, j, lo, hi):
                nr, nc = t.shape
                dst = shard[at:at + nr * nc].view(nr, nc)
                if cast == "w_fwd":
                    v = t / s[j][r:r + nr].to(dt).view(nr, 1)
                elif cast == "w_dgrad":
                    v = t / s[j][n + c:n + c + nc].to(dt).view(1, nc)
                else:  # blockwise: per block row, the column tiles' scales along the row
                    v = torch.empty_like(t)
                    for br in range(r // TILE, (r + nr - 1) // TILE + 1):
                        a0, a1 = max(br * TILE, r) - r, min((br + 1) * TILE, r + nr) - r
                        cols = s[j][br].to(dt).repeat_interleave(TILE)[c:c + nc]
                        torch.div(t[a0:a1], cols, out=v[a0:a1])
                dst.copy_(v.clamp_(-fmax, fmax))
        return shard

    def _fp8(self, data: torch.Tensor, s: torch.Tensor, cast: str) -> dict[str, Any]:
        """The operands one gathered cast of a weight serves (``fp8_mod.provide``)."""
        one = fp8_mod.ALL
        if cast == "w_fwd":  # per row of W: Wᵀ's per-column scales
            return {"w_fwd": fp8_mod.Fp8(data, s[:data.shape[0]].view(-1, 1), (1, one)).t()}
        if cast == "w_dgrad":
            return {"w_dgrad": fp8_mod.Fp8(data, s[data.shape[0]:].view(1, -1), (one, 1))}
        if self.recipe == "blockwise":
            q = fp8_mod.Fp8(data, s, (TILE, TILE))
        else:
            q = fp8_mod.Fp8(data, s.view(1, 1), (one, one))
        return {"w_fwd": q.t(), "w_dgrad": q}

    def start(self, b: Bucket, roles: tuple[str, ...] = ROLES) -> list[Any]:
        """Cast the shard for the operands ``roles`` (rowwise: each its cast; the others: the
        one), start its all-gathers (async), provide every weight's fp8 operands."""
        s = self.scale(b)
        casts = self.casts(roles)
        self.gathered[b.index] = casts
        provided: list[dict[str, Any]] = [{} for _ in b.params]
        handles = []
        for cast in casts:
            shard = self._cast_shard(b, s, cast)
            full = self.full[(b.index, cast)]
            full.untyped_storage().resize_(b.padded)
            data = full.view(fp8_mod.E4M3)
            for j, (p, off) in enumerate(zip(b.params, b.offsets)):
                provided[j].update(self._fp8(data[off:off + p.numel()].view(p.shape), s[j], cast))
            handles.append(ops.all_gather_into(full, shard.view(torch.uint8), b.group,
                                               async_op=True))
        for p, q in zip(b.params, provided):
            fp8_mod.provide(p, q)
        return handles

    def free(self, b: Bucket) -> None:
        for p in b.params:
            fp8_mod.provide(p, None)
        for cast in self.gathered.pop(b.index, ()):
            self.full[(b.index, cast)].untyped_storage().resize_(0)
