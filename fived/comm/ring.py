"""Ring all-reduce, reduce-scatter and all-gather built from point-to-point send/recv.

The bandwidth-optimal ring (Patarasuk & Yuan 2009; the algorithm behind NCCL's and Horovod's
ring all-reduce). The ``n`` members form a ring ``m -> m+1 (mod n)``; the buffer is cut into
``n`` equal chunks (padded with zeros at the end when its length is not a multiple of ``n``).

* **reduce-scatter**, ``n−1`` steps: at step ``s`` member ``m`` sends chunk ``(m−s−1) mod n`` to
  ``m+1`` and adds the chunk ``(m−s−2) mod n`` it receives from ``m−1`` into its own copy.
  After the last step member ``m`` holds chunk ``m`` reduced over all members.
* **all-gather**, ``n−1`` steps: at step ``s`` member ``m`` sends chunk ``(m−s) mod n`` (its own
  at step 0, then the one it just received) and receives chunk ``(m−s−1) mod n``.
* **all-reduce** = reduce-scatter then all-gather: ``2(n−1)`` steps.

Every step is one ``fived.comm.ops.exchange`` (a batched isend to the next member and irecv from
the previous one), so the bytes are counted. The whole collective is then recorded once in the
group's ``Traffic`` under the collective's name (``all_reduce``, ``all_gather``,
``reduce_scatter``; override with ``record_as``), exactly as the backend collective would be.

Bytes one member sends, with ``c = ceil(R/n)`` rows of ``b`` bytes per chunk (``R`` rows along
the split dimension; a flat tensor has rows of one element)::

    reduce_scatter  (n−1)·c·b       = volume.bytes_sent("reduce_scatter", R·b, n) + (n−1)·(c−R/n)·b
    all_reduce      2·(n−1)·c·b     = volume.bytes_sent("all_reduce", R·b, n)     + 2(n−1)·(c−R/n)·b
    all_gather      (n−1)·R_in·b    = volume.bytes_sent("all_gather", n·R_in·b, n)   (no padding)

so the recorded bytes equal the backend collective's exactly when ``R`` is a multiple of ``n``,
and exceed them by the padding rows that travel otherwise.

Reduce-scatter of a length not divisible by ``n``: member ``m`` receives rows
``[m·c, min((m+1)·c, R))`` of the sum (the boundaries ``torch.chunk`` uses; a trailing member may
get zero rows).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from . import ops

_ACC = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


class _Tally:
    """Stands in for a group's Traffic while a ring runs: sums what the steps send."""

    def __init__(self) -> None:
        self.bytes = 0.0

    def add(self, dim: str, op: str, nbytes: float, seconds: float = 0.0) -> None:
        self.bytes += nbytes

    def add_seconds(self, dim: str, op: str, seconds: float) -> None:
        pass


class _Ring:
    """The ring of one group: its neighbours and an exchange whose bytes are tallied."""

    def __init__(self, group: Any):
        self.group = group
        self.n, self.me = group.size, group.rank
        self.next, self.prev = (self.me + 1) % self.n, (self.me - 1) % self.n
        self.tally = _Tally()
        self.p2p = replace(group, traffic=self.tally) if group.traffic is not None else group
        self.t0 = time.perf_counter()

    def step(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        ops.exchange(self.p2p, [(send, self.next)], [(recv, self.prev)])

    def record(self, op: str) -> None:
        if self.group.traffic is not None:
            self.group.traffic.add(self.group.name, op, self.tally.bytes,
                                   time.perf_counter() - self.t0)


def _rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` as a contiguous 2-D (rows along ``dim``, everything else) tensor."""
    src = t.movedim(dim, 0) if dim != 0 else t
    src = src.contiguous()
    return src.reshape(src.shape[0], -1) if src.dim() else src.reshape(1, 1)


def _padded(rows: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """A fresh (n·c, k) copy of ``rows`` padded with zero rows; returns it and ``c``."""
    r = rows.shape[0]
    c = -(-r // n)
    buf = torch.zeros((n * c, rows.shape[1]), dtype=rows.dtype, device=rows.device)
    buf[:r].copy_(rows)
    return buf, c


def _reduce_scatter_steps(ring: _Ring, chunks: list[torch.Tensor], op: str) -> None:
    acc = _ACC[op]
    n, me = ring.n, ring.me
    tmp = torch.empty_like(chunks[0])
    for s in range(n - 1):
        ring.step(chunks[(me - s - 1) % n], tmp)
        dst = chunks[(me - s - 2) % n]
        acc(dst, tmp, out=dst)


def _all_gather_steps(ring: _Ring, chunks: list[torch.Tensor]) -> None:
    n, me = ring.n, ring.me
    for s in range(n - 1):
        ring.step(chunks[(me - s) % n], chunks[(me - s - 1) % n])


def ring_all_reduce(t: torch.Tensor, group: Any, op: str = "sum",
                    record_as: str = "all_reduce") -> torch.Tensor:
    """In-place all-reduce of ``t`` over ``group`` by the ring; returns ``t``."""
    if group.size == 1 or t.numel() == 0:
        return t
    if op not in _ACC:
        raise ValueError(f"ring_all_reduce: op {op!r} not in {sorted(_ACC)}")
    ring = _Ring(group)
    in_place = t.is_contiguous() and t.numel() % ring.n == 0
    if in_place:  # work on t's own storage: no copy in or out
        buf = t.detach().view(-1, 1)
    else:
        buf, _ = _padded(t.detach().contiguous().reshape(-1, 1), ring.n)
    chunks = list(buf.chunk(ring.n))
    _reduce_scatter_steps(ring, chunks, op)
    _all_gather_steps(ring, chunks)
    if not in_place:
        with torch.no_grad():
            t.copy_(buf[: t.numel()].view(t.shape))
    ring.record(record_as)
    return t


def ring_reduce_scatter(t: torch.Tensor, group: Any, dim: int = 0, op: str = "sum",
                        record_as: str = "reduce_scatter") -> torch.Tensor:
    """Reduce ``t`` over ``group``; keep this member's chunk of rows along ``dim``.

    The result is a new tensor shaped like ``t`` with ``dim`` cut to this member's rows
    (``ceil(R/n)``, fewer for trailing members when ``R`` is not a multiple of ``n``).
    """
    if group.size == 1:
        return t
    if t.dim() == 0 or t.shape[dim] == 0:
        raise ValueError("ring_reduce_scatter: needs at least one row along dim")
    if op not in _ACC:
        raise ValueError(f"ring_reduce_scatter: op {op!r} not in {sorted(_ACC)}")
    ring = _Ring(group)
    moved = t.movedim(dim, 0) if dim != 0 else t
    rows = _rows(t.detach(), dim)
    buf, c = _padded(rows, ring.n)
    chunks = list(buf.chunk(ring.n))
    _reduce_scatter_steps(ring, chunks, op)
    lo, hi = min(ring.me * c, rows.shape[0]), min((ring.me + 1) * c, rows.shape[0])
    mine = chunks[ring.me][: hi - lo].reshape((hi - lo,) + tuple(moved.shape[1:]))
    ring.record(record_as)
    return mine.movedim(0, dim) if dim != 0 else mine


def ring_all_gather(t: torch.Tensor, group: Any, dim: int = 0,
                    record_as: str = "all_gather") -> torch.Tensor:
    """Concatenate every member's ``t`` (equal shapes) along ``dim`` by the ring."""
    if group.size == 1:
        return t
    if t.dim() == 0 or t.numel() == 0:
        raise ValueError("ring_all_gather: needs a non-empty tensor with at least one dimension")
    ring = _Ring(group)
    moved = t.movedim(dim, 0) if dim != 0 else t
    rows = _rows(t.detach(), dim)
    out = torch.empty((ring.n * rows.shape[0], rows.shape[1]), dtype=t.dtype, device=t.device)
    chunks = list(out.chunk(ring.n))
    chunks[ring.me].copy_(rows)
    _all_gather_steps(ring, chunks)
    full = out.reshape((ring.n * moved.shape[0],) + tuple(moved.shape[1:]))
    ring.record(record_as)
    return full.movedim(0, dim) if dim != 0 else full
