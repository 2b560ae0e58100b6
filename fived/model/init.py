"""Layout-independent initialisation, drawn block by block so any slice costs only its blocks.

A parameter's values depend only on (seed, its global name), never on the layout. Each
parameter, seen as a matrix (rows = the product of all but its last dimension, cols = the last;
a vector is one row), is tiled into fixed ``TILE × TILE`` blocks; block (i, j) is drawn as
N(0, std²) from its own generator seeded by a stable hash (CRC-32 of ``"{seed}/{name}/{i}/{j}"``,
never Python's randomised ``hash``). A rank that holds a slice — some rows (a column-parallel
cut, a vocab shard), some columns (a row-parallel cut) — draws only the blocks its slice
touches, one block at a time, and copies their intersection with the slice into its own
storage: the transient is one block (``TILE² `` fp32 = 256 KiB), whatever the tensor.

``fill_piece(out, seed, name, shape, std, dim, parts, index)`` writes chunk ``index`` of
``parts`` equal chunks along ``dim`` of the full tensor into ``out``; ``full_param`` is the
same with one part (the one-rank reference, tests). So the slices of any two layouts assemble
to the same full tensor, bit for bit (``tests/test_born_sharded.py``).
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

TILE = 256  # block edge: a block is at most TILE × TILE elements


def _block_seed(seed: int, name: str, i: int, j: int) -> int:
    return (zlib.crc32(f"{seed}/{name}/{i}/{j}".encode()) + (int(seed) << 32)) % (2**63)


def piece_box(shape: tuple[int, ...], dim: int, parts: int, index: int
              ) -> tuple[tuple[int, int], ...]:
    """(start, stop) per dimension of chunk ``index`` of ``parts`` along ``dim``."""
    box = [(0, n) for n in shape]
    if parts > 1:
        size = shape[dim] // parts
        box[dim] = (index * size, (index + 1) * size)
    return tuple(box)


def _ranges(shape: tuple[int, ...], dim: int, parts: int, index: int
            ) -> tuple[int, int, tuple[int, int], tuple[int, int]]:
    """The full tensor as a (rows, cols) matrix and the piece as a row and a column range: a cut
    of dim 0 is a row range, a cut of the last dim a column range (the cuts fived makes)."""
    rows, cols = (math.prod(shape[:-1]) if len(shape) > 1 else 1), (shape[-1] if shape else 1)
    (a, b), last = (0, rows), (0, cols)
    if parts > 1:
        lo, hi = piece_box(shape, dim, parts, index)[dim]
        if dim == len(shape) - 1:
            last = (lo, hi)
        elif dim == 0:
            inner = rows // shape[0]
            a, b = lo * inner, hi * inner
        else:
            raise ValueError(f"a cut of dim {dim} of {shape}: fived cuts dim 0 or the last")
    return rows, cols, (a, b), last


@torch.no_grad()
def fill_piece(out: torch.Tensor, seed: int, name: str, shape: tuple[int, ...], std: float,
               dim: int = 0, parts: int = 1, index: int = 0) -> torch.Tensor:
    """Write chunk ``index`` of ``parts`` along ``dim`` of parameter ``name`` (global
    ``shape``, N(0, std²) or ones when ``std`` is 0) into ``out``, drawing only its blocks."""
    if std == 0.0:
        return out.fill_(1.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # block-sized ops: a thread pool's wake-ups cost more than they give
    try:
        return _fill(out, seed, name, tuple(shape), std, dim, parts, index)
    finally:
        torch.set_num_threads(threads)


def _fill(out: torch.Tensor, seed: int, name: str, shape: tuple[int, ...], std: float,
          dim: int, parts: int, index: int) -> torch.Tensor:
    rows, cols, (r0, r1), (c0, c1) = _ranges(shape, dim, parts, index)
    dest = out.view(r1 - r0, c1 - c0)
    for i in range(r0 // TILE, (r1 - 1) // TILE + 1):
        br0, br1 = i * TILE, min((i + 1) * TILE, rows)
        for j in range(c0 // TILE, (c1 - 1) // TILE + 1):
            bc0, bc1 = j * TILE, min((j + 1) * TILE, cols)
            g = torch.Generator().manual_seed(_block_seed(seed, name, i, j))
            block = torch.randn((br1 - br0, bc1 - bc0), generator=g, dtype=torch.float32) * std
            a0, a1, b0, b1 = max(r0, br0), min(r1, br1), max(c0, bc0), min(c1, bc1)
            dest[a0 - r0:a1 - r0, b0 - c0:b1 - c0].copy_(block[a0 - br0:a1 - br0,
                                                                b0 - bc0:b1 - bc0])
    return out


def full_param(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """The full fp32 tensor for parameter ``name``: N(0, std²), or ones when ``std`` is 0."""
    return fill_piece(torch.empty(shape, dtype=torch.float32), seed, name, shape, std)


def shard(full: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """The ``index``-th of ``parts`` equal chunks of ``full`` along ``dim`` (a copy; on the meta
    device, a meta tensor of the chunk's shape)."""
    if parts == 1:
        return full
    return full.chunk(parts, dim=dim)[index].clone().contiguous()


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std_of) -> nn.Module:
    """Draw every parameter of ``model`` from (seed, its name); ``std_of(name)`` gives its std."""
    for name, p in model.named_parameters():
        fill_piece(p.data, seed, name, tuple(p.shape), std_of(name))
    return model


class InitSource:
    """Fills a parameter's piece from (seed, name): the born-sharded path's initialiser
    (``fived.parallel.data.layout.Layout.fill`` calls ``fill`` for each meta parameter)."""

    def __init__(self, seed: int, std_of):
        self.seed, self.std_of = seed, std_of

    def fill(self, out: torch.Tensor, name: str, shape: tuple[int, ...], dim: int = 0,
             parts: int = 1, index: int = 0) -> torch.Tensor:
        return fill_piece(out, self.seed, name, shape, self.std_of(name), dim, parts, index)
