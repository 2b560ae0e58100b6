"""Accounted collectives: every call records (op, dimension, bytes sent, seconds) in ``Traffic``.

Each function takes a ``fived.ranks.grid.DimGroup``; the group names the dimension the bytes are
charged to and carries the rank's ``Traffic``. Bytes follow ``fived.comm.volume.bytes_sent``
(the ring-algorithm bytes this rank sends), so the ledger can predict them exactly.
A group of one rank is a no-op and records nothing.

Which gather/scatter spelling the installed torch has (``all_gather_single`` in 2.13,
``all_gather_into_tensor`` before) is hidden here.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .volume import bytes_sent

_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass
class Record:
    calls: int = 0
    bytes: float = 0.0
    seconds: float = 0.0


@dataclass
class Traffic:
    """Per-rank counters keyed by (dimension, op); read and reset once per step."""

    records: dict[tuple[str, str], Record] = field(default_factory=lambda: defaultdict(Record))
    enabled: bool = True

    def add(self, dim: str, op: str, nbytes: float, seconds: float = 0.0) -> None:
        if self.enabled:
            r = self.records[(dim, op)]
            r.calls += 1
            r.bytes += nbytes
            r.seconds += seconds

    def add_seconds(self, dim: str, op: str, seconds: float) -> None:
        if self.enabled:
            self.records[(dim, op)].seconds += seconds

    def reset(self) -> None:
        self.records = defaultdict(Record)

    def bytes_by_dim(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for (dim, _), r in self.records.items():
            out[dim] += r.bytes
        return dict(out)

    def seconds_by_dim(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for (dim, _), r in self.records.items():
            out[dim] += r.seconds
        return dict(out)

    def total_seconds(self) -> float:
        return sum(r.seconds for r in self.records.values())

    def as_dict(self) -> dict[str, dict[str, dict[str, float]]]:
        out: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
        for (dim, op), r in sorted(self.records.items()):
            out[dim][op] = {"calls": r.calls, "bytes": r.bytes, "seconds": r.seconds}
        return dict(out)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Handle:
    """An asynchronous collective in flight; ``wait()`` charges the waiting time."""

    def __init__(self, work: Any, group: Any, op: str, result: Any = None, t0: float = 0.0):
        self.work, self.group, self.op, self.result, self.t0 = work, group, op, result, t0

    def wait(self) -> Any:
        if self.work is not None:
            t = time.perf_counter()
            self.work.wait()
            if self.group.traffic is not None:
                self.group.traffic.add_seconds(self.group.name, self.op, time.perf_counter() - t)
            self.work = None
        return self.result


def _record(group: Any, op: str, nbytes: float, t0: float) -> None:
    if group.traffic is not None:
        group.traffic.add(group.name, op, nbytes, time.perf_counter() - t0)


def _run(group: Any, op: str, size: int, fn, async_op: bool, result: Any) -> Any:
    """Run the collective ``fn(async_op)`` and charge ``group`` for it (``_charge``): a blocking
    one with its seconds, an asynchronous one with none (its ``Handle.wait`` adds them)."""
    t0 = time.perf_counter()
    if async_op:
        out, seconds = Handle(fn(True), group, op, result, t0), 0.0
    elif isinstance(result, torch.Tensor) and result.is_cuda:
        out, seconds = result, _cuda_seconds(fn)
    else:
        fn(False)
        out, seconds = result, time.perf_counter() - t0
    _charge(group, op, size, seconds)
    return out


def _cuda_seconds(fn) -> float:
    """A blocking collective on cuda tensors, timed with CUDA events (NCCL returns to the host
    before the transfer ends, so a host clock would time the launch only)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(False)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _charge(group: Any, op: str, size: int, seconds: float) -> None:
    """The bytes this rank sends for ``op`` on a buffer of ``size`` bytes
    (``volume.bytes_sent``), and ``seconds``, to ``group``'s traffic."""
    if group.traffic is not None:
        group.traffic.add(group.name, op, bytes_sent(op, size, group.size), seconds)


def _done(result: Any, async_op: bool) -> Any:
    return Handle(None, None, "", result) if async_op else result


def all_reduce(t: torch.Tensor, group: Any, op: str = "sum", async_op: bool = False) -> Any:
    """In-place all-reduce of ``t`` over ``group``."""
    if group.size == 1:
        return _done(t, async_op)
    return _run(
        group, "all_reduce", _nbytes(t),
        lambda a: dist.all_reduce(t, op=_OPS[op], group=group.pg, async_op=a), async_op, t,
    )


def all_gather(t: torch.Tensor, group: Any, dim: int = 0, async_op: bool = False) -> Any:
    """Concatenate every rank's ``t`` along ``dim`` (equal shapes)."""
    if group.size == 1:
        return _done(t, async_op)
    n = group.size
    src = t.movedim(dim, 0).contiguous() if dim != 0 else t.contiguous()
    out = torch.empty((n * src.shape[0],) + tuple(src.shape[1:]), dtype=t.dtype, device=t.device)
    result = out.movedim(0, dim) if dim != 0 else out
    return _run(
        group, "all_gather", _nbytes(out),
        lambda a: _AG(out, src, group=group.pg, async_op=a), async_op, result,
    )


def all_gather_into(out: torch.Tensor, t: torch.Tensor, group: Any, async_op: bool = False) -> Any:
    """All-gather flat ``t`` into the preallocated flat ``out`` (n·t.numel() elements)."""
    if group.size == 1:
        out.copy_(t)
        return _done(out, async_op)
    return _run(
        group, "all_gather", _nbytes(out),
        lambda a: _AG(out, t, group=group.pg, async_op=a), async_op, out,
    )


def reduce_scatter(
    t: torch.Tensor, group: Any, dim: int = 0, op: str = "sum", async_op: bool = False,
    out: torch.Tensor | None = None,
) -> Any:
    """Sum ``t`` over the group and keep this rank's 1/n slice along ``dim``."""
    if group.size == 1:
        if out is not None:
            out.copy_(t)
            return _done(out, async_op)
        return _done(t, async_op)
    n = group.size
    src = t.movedim(dim, 0).contiguous() if dim != 0 else t.contiguous()
    if src.shape[0] % n:
        raise ValueError(f"reduce_scatter: size {src.shape[0]} along dim {dim} not divisible by {n}")
    if out is None:
        buf = torch.empty((src.shape[0] // n,) + tuple(src.shape[1:]), dtype=t.dtype,
                          device=t.device)
        result = buf.movedim(0, dim) if dim != 0 else buf
    else:
        buf = result = out
    return _run(
        group, "reduce_scatter", _nbytes(src),
        lambda a: _RS(buf, src, op=_OPS[op], group=group.pg, async_op=a), async_op, result,
    )


def all_to_all(
    t: torch.Tensor, group: Any, in_splits: list[int] | None = None,
    out_splits: list[int] | None = None, async_op: bool = False,
) -> Any:
    """Rows of ``t`` split by ``in_splits`` go to each rank; rows received per ``out_splits``.

    Bytes recorded are the rows sent to *other* ranks (exact for uneven splits).
    """
    if group.size == 1:
        return _done(t, async_op)
    t = t.contiguous()
    n = group.size
    row = _nbytes(t) // max(t.shape[0], 1) if t.shape[0] else 0
    if in_splits is None:
        own = t.shape[0] // n
        out_rows = t.shape[0]
    else:
        own = in_splits[group.rank]
        out_rows = sum(out_splits) if out_splits is not None else t.shape[0]
    out = torch.empty((out_rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    sent = (t.shape[0] - own) * row
    t0 = time.perf_counter()
    work = dist.all_to_all_single(
        out, t, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group.pg,
        async_op=async_op,
    )
    if group.traffic is not None:
        group.traffic.add(group.name, "all_to_all", float(sent), 0.0 if async_op else
                          time.perf_counter() - t0)
    return Handle(work, group, "all_to_all", out, t0) if async_op else out


def broadcast(t: torch.Tensor, group: Any, src: int = 0) -> torch.Tensor:
    """Broadcast from the group's ``src``-th member, in place."""
    if group.size == 1:
        return t
    t0 = time.perf_counter()
    dist.broadcast(t, src=group.global_rank(src), group=group.pg)
    _record(group, "broadcast", _nbytes(t) if group.rank == src else 0.0, t0)
    return t


def reduce(t: torch.Tensor, group: Any, dst: int = 0, op: str = "sum") -> torch.Tensor:
    if group.size == 1:
        return t
    t0 = time.perf_counter()
    dist.reduce(t, dst=group.global_rank(dst), op=_OPS[op], group=group.pg)
    _record(group, "reduce", _nbytes(t) if group.rank != dst else 0.0, t0)
    return t


def scatter(chunks: list[torch.Tensor] | None, out: torch.Tensor, group: Any,
            src: int = 0) -> torch.Tensor:
    """The ``src`` member sends ``chunks[i]`` to member i."""
    if group.size == 1:
        out.copy_(chunks[0])
        return out
    t0 = time.perf_counter()
    dist.scatter(out, chunks if group.rank == src else None, src=group.global_rank(src),
                 group=group.pg)
    sent = _nbytes(out) * (group.size - 1) if group.rank == src else 0.0
    _record(group, "scatter", sent, t0)
    return out


def gather(t: torch.Tensor, group: Any, dst: int = 0) -> list[torch.Tensor] | None:
    if group.size == 1:
        return [t]
    outs = [torch.empty_like(t) for _ in range(group.size)] if group.rank == dst else None
    t0 = time.perf_counter()
    dist.gather(t, outs, dst=group.global_rank(dst), group=group.pg)
    _record(group, "gather", _nbytes(t) if group.rank != dst else 0.0, t0)
    return outs


def send(t: torch.Tensor, group: Any, dst: int) -> None:
    """Send to the group's ``dst``-th member."""
    t0 = time.perf_counter()
    dist.send(t.contiguous(), dst=group.global_rank(dst), group=group.pg)
    _record(group, "send", _nbytes(t), t0)


def recv(t: torch.Tensor, group: Any, src: int) -> torch.Tensor:
    t0 = time.perf_counter()
    dist.recv(t, src=group.global_rank(src), group=group.pg)
    _record(group, "recv", 0.0, t0)
    return t


def exchange(
    group: Any, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
    async_op: bool = False,
) -> Any:
    """Batched point-to-point: post every send and receive together (no ordering deadlock).

    ``sends``/``recvs`` hold (tensor, member index in ``group``).
    """
    ops = [dist.P2POp(dist.isend, t.contiguous(), group.global_rank(p), group.pg) for t, p in sends]
    ops += [dist.P2POp(dist.irecv, t, group.global_rank(p), group.pg) for t, p in recvs]
    if not ops:
        return _done(None, async_op)
    t0 = time.perf_counter()
    works = dist.batch_isend_irecv(ops)
    nbytes = float(sum(_nbytes(t) for t, _ in sends))
    if group.traffic is not None:
        group.traffic.add(group.name, "send", nbytes, 0.0)
    handle = _Multi(works, group, t0)
    if async_op:
        return handle
    handle.wait()
    return None


class _Multi(Handle):
    def __init__(self, works: list[Any], group: Any, t0: float):
        super().__init__(works, group, "send", None, t0)

    def wait(self) -> Any:
        if self.work is not None:
            t = time.perf_counter()
            for w in self.work:
                w.wait()
            if self.group.traffic is not None:
                self.group.traffic.add_seconds(self.group.name, "send", time.perf_counter() - t)
            self.work = None
        return self.result


def barrier(group: Any) -> None:
    if group.size > 1:
        dist.barrier(group=group.pg)
