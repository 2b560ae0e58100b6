"""What an optimizer needs to know about a sharded parameter: which elements of which matrix this
rank holds, and the reductions that complete a row or column statistic.

A data-parallel engine keeps flat buckets; ZeRO gives each member an equal contiguous slice of a
bucket, cut at arbitrary elements. A ``Piece`` describes one parameter of a bucket on this rank:

* ``shape``  the tensor this rank holds (its tensor-parallel chunk) seen as a matrix (R, C)
             (a 1-D parameter of n elements is the (1, n) matrix);
* ``gshape`` the global matrix; ``dim``/``parts``/``index`` the tp cut (``Placement``);
* ``off``    the parameter's offset in the bucket's flat buffer;
* ``start, end``  the elements of the local tensor (row-major) that this rank owns (may be
             empty); ``lo, hi`` the same elements in the rank's owned shard of the bucket.

Every rank of a ZeRO group sees the same buckets and the same pieces (with different owned
ranges), so a buffer laid out over *all* pieces of a group is the same on every member.

Statistics over a row (Σ_j x_ij) or a column (Σ_i x_ij) of the global matrix are completed by
``reduce_stats``: each rank writes the partial sums of the elements it owns (zero elsewhere), then

    all-reduce over the ZeRO group          when the bucket is sharded and the statistic is cut
    all-reduce over tp                      when the tp cut splits the row (dim 1, row sums) or
                                            the column (dim 0, column sums)

The tp part is weighted by ``parts / tp`` first, so a chunk that ``tp / parts`` ranks hold (k/v
projections with tp > kv_heads) is counted once. One buffer per (bucket group, step): the bytes
are ``2(N−1)/N · 4 · (slots)`` (``fived.ledger.optimizers`` predicts them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..comm import ops


@dataclass
class Piece:
    name: str
    shape: tuple[int, int]     # local matrix (R, C)
    gshape: tuple[int, int]    # global matrix
    dim: int                   # tp cut dimension of the matrix (0 rows, 1 columns)
    parts: int
    index: int
    off: int                   # offset of the parameter in the bucket's flat buffer
    start: int                 # owned local elements [start, end)
    end: int
    lo: int                    # the same elements in the owned shard [lo, hi)
    hi: int
    ndim: int = 2              # the parameter's own number of dimensions
    cache: dict = field(default_factory=dict, repr=False)

    @property
    def owned(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def rows_of(self) -> torch.Tensor:
        """Row index of each owned element."""
        if "rows" not in self.cache:
            self.cache["rows"] = torch.arange(self.start, self.end) // self.shape[1]
        return self.cache["rows"]

    def cols_of(self) -> torch.Tensor:
        if "cols" not in self.cache:
            self.cache["cols"] = torch.arange(self.start, self.end) % self.shape[1]
        return self.cache["cols"]

    def row_sums(self, x: torch.Tensor) -> torch.Tensor:
        """Σ over each local row of the owned elements ``x`` (zeros for rows not owned)."""
        out = torch.zeros(self.shape[0], dtype=torch.float32)
        if self.owned:
            out.index_add_(0, self.rows_of(), x)
        return out

    def col_sums(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.shape[1], dtype=torch.float32)
        if self.owned:
            out.index_add_(0, self.cols_of(), x)
        return out



def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """A parameter as a matrix: 2-D as is, 1-D of n elements as (1, n)."""
    if len(shape) == 1:
        return (1, int(shape[0]))
    if len(shape) == 2:
        return (int(shape[0]), int(shape[1]))
    raise ValueError(f"parameters are 1-D or 2-D here, not {shape}")


@dataclass
class BucketPieces:
    """One bucket as an optimizer sees it: its ZeRO group (``sharded``: more than one member
    owns a slice), and a piece per parameter (all of them, owned or not)."""

    index: int
    group_name: str
    group: Any
    sharded: bool
    shard_numel: int
    padded: int
    pieces: list[Piece]


def tp_needs(p: Piece, kind: str) -> bool:
    """Whether a row (kind 'row') or column ('col') statistic of ``p`` is split over tp."""
    return p.parts > 1 and ((kind == "row" and p.dim == 1) or (kind == "col" and p.dim == 0))


def reduce_stats(entries: list[tuple[BucketPieces, Piece, str, torch.Tensor]], grid: Any,
                 zero: bool = True) -> list[torch.Tensor]:
    """Complete each (bucket, piece, kind, partial) statistic in place and return them.

    One buffer per bucket group (in sorted name order, the same on every rank): the slots that
    tp also splits first, then the rest. ``zero=False``: the ZeRO reduction is not needed (row
    statistics on shards aligned to whole rows)."""
    tp = grid["tp"] if grid is not None else None
    by_group: dict[str, list[int]] = {}
    for i, (b, _, _, _) in enumerate(entries):
        by_group.setdefault(b.group_name, []).append(i)
    out = [e[3] for e in entries]
    for name in sorted(by_group):
        idx = by_group[name]
        tp_idx = [i for i in idx if tp_needs(entries[i][1], entries[i][2])]
        rest = [i for i in idx if i not in set(tp_idx)]
        order = tp_idx + rest
        if tp is not None and tp.size > 1:
            for i in tp_idx:
                p = entries[i][1]
                if p.parts < tp.size:
                    out[i] = out[i] * (p.parts / tp.size)
        buf = torch.cat([out[i] for i in order]) if order else torch.zeros(0)
        b0 = entries[idx[0]][0]
        if zero and b0.sharded and buf.numel():
            ops.all_reduce(buf, b0.group)
        n_tp = sum(out[i].numel() for i in tp_idx)
        if tp is not None and tp.size > 1 and n_tp:
            ops.all_reduce(buf[:n_tp], tp)
        at = 0
        for i in order:
            n = out[i].numel()
            out[i] = buf[at:at + n]
            at += n
    return out
