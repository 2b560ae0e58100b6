"""Ring all-reduce, reduce-scatter and all-gather built from point-to-point send/recv.

The bandwidth-optimal ring (Patarasuk & Yuan 2009; the algorithm behind NCCL's and Horovod's
ring all-reduce). The ``n`` members form a ring ``m -> m+1 (mod n)``; the buffer is cut into
``n`` chunks: all-reduce cuts the flat buffer in place into ``tensor_split`` chunks of
``⌊N/n⌋`` or ``⌈N/n⌉`` elements (no padding, no copy); reduce-scatter and all-gather cut rows
along ``dim`` into chunks of ``c = ceil(R/n)`` rows (reduce-scatter pads with zero rows).

* **reduce-scatter**, ``n−1`` steps: at step ``s`` member ``m`` sends chunk ``(m−s−1) mod n`` to
  ``m+1`` and adds the chunk ``(m−s−2) mod n`` it receives from ``m−1`` into its own copy.
  After the last step member ``m`` holds chunk ``m`` reduced over all members.
* **all-gather**, ``n−1`` steps: at step ``s`` member ``m`` sends chunk ``(m−s) mod n`` (its own
  at step 0, then the one it just received) and receives chunk ``(m−s−1) mod n``.
* **all-reduce** = reduce-scatter then all-gather: ``2(n−1)`` steps.

**Pipelined** (``_Ring.run``): what step ``s`` sends is what step ``s−1`` received, so every
chunk travels as ``P`` pieces of about ``PIECE_BYTES``; piece ``k`` of step ``s`` is isent as
soon as piece ``k`` of step ``s−1`` has arrived and been reduced, receives are posted
``WINDOW_STEPS`` steps ahead, and gloo moves one piece while this member adds the previous one.

The bytes sent are tallied and the whole collective is recorded once in the group's
``Traffic`` under the collective's name (``all_reduce``, ``all_gather``, ``reduce_scatter``;
override with ``record_as``), exactly as the backend collective would be.

Bytes member ``m`` sends, ``b`` bytes per row (a flat tensor has rows of one element), ``c_i``
the all-reduce's chunk lengths::

    reduce_scatter  (n−1)·c·b            = volume.bytes_sent("reduce_scatter", R·b, n) + (n−1)·(c−R/n)·b
    all_reduce      (2N − c_m − c_{m+1})·b = volume.bytes_sent("all_reduce", N·b, n) when n | N
    all_gather      (n−1)·R_in·b         = volume.bytes_sent("all_gather", n·R_in·b, n)

so the recorded bytes equal the backend collective's exactly when ``n`` divides the length
(always for an all-reduce on two members); otherwise reduce-scatter sends its padding rows and
all-reduce's per-member bytes differ from 2(n−1)/n·N·b by less than two elements (their sum over
the members is exact).

Reduce-scatter of a length not divisible by ``n``: member ``m`` receives rows
``[m·c, min((m+1)·c, R))`` of the sum (the boundaries ``torch.chunk`` uses; a trailing member may
get zero rows).
"""

from __future__ import annotations

import time
from typing import Any

import torch

_ACC = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


#: bytes per pipelined piece: a chunk travels as pieces of about this size, so that the next
#: member reduces (and forwards) one piece while the following one is still on the wire
PIECE_BYTES = 1 << 21
#: receives are posted this many steps ahead of the one being reduced
WINDOW_STEPS = 2


class _Ring:
    """The ring of one group: its neighbours, the bytes this member sent, the clock."""

    def __init__(self, group: Any):
        self.group = group
        self.n, self.me = group.size, group.rank
        self.next, self.prev = (self.me + 1) % self.n, (self.me - 1) % self.n
        self.dst, self.src = group.global_rank(self.next), group.global_rank(self.prev)
        self.bytes = 0.0
        self.t0 = time.perf_counter()

    def run(self, steps: list[tuple[torch.Tensor, torch.Tensor, bool]], op: str = "sum",
            piece_bytes: int = PIECE_BYTES) -> None:
        """Run a chain of ring steps, pipelined by pieces.

        ``steps[s] = (send, recv, reduce)``: send this member's ``send`` to the next member,
        receive the previous member's tensor of ``recv``'s shape and either add it into
        ``recv`` (``reduce``) or store it there. The chain property the ring algorithms have:
        what step ``s`` sends is what step ``s − 1`` received (reduced). Each tensor is cut
        into the same ``P`` pieces, so piece ``k`` of step ``s`` is sent as soon as piece ``k``
        of step ``s − 1`` has arrived and been reduced — the pieces of consecutive steps
        overlap on the wire, the reductions overlap the transfers (gloo moves the bytes on its
        own thread), and nothing is copied but the received pieces that are reduced.
        """
        import torch.distributed as dist

        if not steps:
            return
        acc = _ACC[op]
        width = max(t.numel() for step in steps for t in step[:2])
        el = steps[0][0].element_size()
        p = max(1, min(width, -(-width * el // piece_bytes)))
        msgs = []  # (send piece, recv piece, reduce) in send order, p per step
        for send, recv, red in steps:
            msgs += list(zip(send.tensor_split(p), recv.tensor_split(p), [red] * p))
        per_step = p
        window = WINDOW_STEPS * per_step + 1  # receives posted ahead
        slot_len = max(m[1].numel() for m in msgs)
        slots = [torch.empty(slot_len, dtype=msgs[0][1].dtype, device=msgs[0][1].device)
                 for _ in range(min(window, len(msgs)))] if any(m[2] for m in msgs) else []
        recvs: dict[int, tuple[Any, torch.Tensor | None]] = {}
        pg = self.group.pg

        def post(j: int) -> None:
            if j >= len(msgs):
                return
            _, rbuf, red = msgs[j]
            if not rbuf.numel():  # an empty piece (a chunk shorter than p): nothing travels
                recvs[j] = (None, None)
                return
            tmp = slots[j % len(slots)][: rbuf.numel()].view(rbuf.shape) if red else None
            recvs[j] = (dist.irecv(tmp if red else rbuf, self.src, group=pg), tmp)

        def finish(j: int) -> None:
            work, tmp = recvs.pop(j)
            if work is not None:
                work.wait()
            if tmp is not None:
                dst = msgs[j][1]
                acc(dst, tmp, out=dst)
            post(j + window)

        for j in range(min(window, len(msgs))):
            post(j)
        sends = []
        for j, (sbuf, _, _) in enumerate(msgs):
            if j >= per_step:
                finish(j - per_step)  # what this message sends arrived one step ago
            if sbuf.numel():
                sends.append(dist.isend(sbuf, self.dst, group=pg))
            self.bytes += sbuf.numel() * el
        for j in range(max(0, len(msgs) - per_step), len(msgs)):
            finish(j)
        for w in sends:
            w.wait()

    def record(self, op: str) -> None:
        if self.group.traffic is not None:
            self.group.traffic.add(self.group.name, op, self.bytes,
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


def _reduce_scatter_steps(n: int, me: int, chunks: list[torch.Tensor]) -> list:
    """At step ``s`` send chunk ``(me−s−1) mod n``, reduce into chunk ``(me−s−2) mod n``."""
    return [(chunks[(me - s - 1) % n].reshape(-1), chunks[(me - s - 2) % n].reshape(-1), True)
            for s in range(n - 1)]


def _all_gather_steps(n: int, me: int, chunks: list[torch.Tensor]) -> list:
    """At step ``s`` send chunk ``(me−s) mod n``, receive chunk ``(me−s−1) mod n``."""
    return [(chunks[(me - s) % n].reshape(-1), chunks[(me - s - 1) % n].reshape(-1), False)
            for s in range(n - 1)]


def ring_all_reduce(t: torch.Tensor, group: Any, op: str = "sum",
                    record_as: str = "all_reduce") -> torch.Tensor:
    """In-place all-reduce of ``t`` over ``group`` by the ring; returns ``t``."""
    if group.size == 1 or t.numel() == 0:
        return t
    if op not in _ACC:
        raise ValueError(f"ring_all_reduce: op {op!r} not in {sorted(_ACC)}")
    ring = _Ring(group)
    buf = t.detach()
    if not buf.is_contiguous():
        buf = buf.contiguous()
    chunks = list(buf.view(-1).tensor_split(ring.n))  # sizes differ by at most one element
    n, me = ring.n, ring.me
    ring.run(_reduce_scatter_steps(n, me, chunks) + _all_gather_steps(n, me, chunks), op)
    if buf.data_ptr() != t.data_ptr():
        with torch.no_grad():
            t.copy_(buf)
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
    ring.run(_reduce_scatter_steps(ring.n, ring.me, chunks), op)
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
    ring.run(_all_gather_steps(ring.n, ring.me, chunks))
    full = out.reshape((ring.n * moved.shape[0],) + tuple(moved.shape[1:]))
    ring.record(record_as)
    return full.movedim(0, dim) if dim != 0 else full
