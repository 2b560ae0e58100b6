"""Collective benchmarks as nccl-tests defines them: a size sweep, algbw/busbw, an alpha-beta fit.

For a collective named by a buffer of ``S`` bytes (``fived.comm.volume``'s ``S``: the all-reduce
buffer, the all-gather *output*, the reduce-scatter *input*, the all-to-all local input, the
broadcast/reduce buffer, the scatter input / gather output, the send/recv message) that takes
``t`` seconds (median over the timed iterations of the slowest rank's time)::

    algbw = S / t                                   (GB/s, 1 GB = 1e9 bytes)
    busbw = algbw · busbw_factor(op, n)             (2(n−1)/n all-reduce; (n−1)/n all-gather,
                                                     reduce-scatter, all-to-all; 1 otherwise)

``busbw`` is the rate at which each rank's link carries ring bytes, so it is comparable across
collectives and group sizes (nccl-tests, doc/PERFORMANCE.md). The alpha-beta (Hockney) model
``t = alpha + bus_bytes / beta`` with ``bus_bytes = volume.bytes_sent(op, S, n)`` is fitted by
least squares weighted by ``1/t²`` (relative error, so the small sizes fix ``alpha`` and the large
ones ``beta``); ``beta`` is then directly a bus bandwidth that the ledger divides its predicted
``bytes_sent`` by.

This module holds the measuring (it runs on every rank) and the arithmetic; the command line,
spawning and printing are in ``fived.bench.comm``.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from .volume import busbw_factor, bytes_sent

#: the collectives the sweep knows, in the order it runs and prints them
BENCH_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce",
             "scatter", "gather", "sendrecv")
#: the implementations: the backend's own collective (through ``fived.comm.ops``) and fived's ring
IMPLS = ("backend", "ring")
RING_OPS = ("all_reduce", "all_gather", "reduce_scatter")
#: the ``fived.comm.volume`` op each benchmark is charged as (send/recv: every rank sends S)
VOLUME_OP = {op: op for op in BENCH_OPS} | {"sendrecv": "send"}
ALIASES = {"send": "sendrecv", "recv": "sendrecv", "send_recv": "sendrecv", "p2p": "sendrecv",
           "allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
           "alltoall": "all_to_all"}
DTYPES = ("float32", "bfloat16", "float16", "float64", "int32", "int64")
SCHEMA = "fived.bench.comm/1"

_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3}


def parse_size(text: str) -> int:
    """``"512"``, ``"1K"``, ``"16M"``, ``"1G"`` (binary units, as nccl-tests) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:I?B)?\s*", text.upper())
    if not m:
        raise ValueError(f"size {text!r}: give a number with an optional K, M or G suffix")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def format_size(n: float) -> str:
    for unit, scale in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if n >= scale and n % scale == 0:
            return f"{int(n // scale)}{unit}"
    return f"{int(n)}"


def size_sweep(begin: int, end: int, factor: float) -> list[int]:
    """``begin, begin·factor, ...`` up to and including ``end`` (nccl-tests' ``-b -e -f``)."""
    if begin <= 0 or end < begin:
        raise ValueError(f"sizes: need 0 < begin <= end, got {begin}..{end}")
    if factor <= 1:
        raise ValueError(f"size factor must be > 1, got {factor}")
    out, s = [], float(begin)
    while s <= end * (1 + 1e-9):
        out.append(int(s))
        s *= factor
    return out


def canonical_op(name: str) -> str:
    op = ALIASES.get(name.strip().lower(), name.strip().lower())
    if op not in BENCH_OPS:
        raise ValueError(f"unknown collective {name!r}; choose from {', '.join(BENCH_OPS)}")
    return op


def elements(op: str, size_bytes: int, elem_size: int, n: int) -> int:
    """Elements of ``S`` for a requested size: rounded down to a multiple of ``n`` (at least n),
    so every split is equal and the ring needs no padding (nccl-tests rounds the same way)."""
    count = size_bytes // elem_size
    return max(n, count // n * n)


def algbw(size_bytes: float, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes)."""
    return size_bytes / seconds / 1e9 if seconds > 0 else math.inf


def busbw(op: str, n: int, size_bytes: float, seconds: float) -> float:
    """Bus bandwidth in GB/s: ``algbw · busbw_factor``."""
    return algbw(size_bytes, seconds) * busbw_factor(VOLUME_OP[op], n)


def bus_bytes(op: str, size_bytes: float, n: int) -> float:
    """The bytes one rank sends (``volume.bytes_sent``) — the fit's x."""
    return bytes_sent(VOLUME_OP[op], int(size_bytes), n)


@dataclass
class Row:
    op: str
    impl: str
    size_bytes: int
    count: int
    dtype: str
    time_us: float
    algbw_GBps: float
    busbw_GBps: float
    bus_bytes: float
    recorded_bytes: float  # bytes fived.comm's Traffic charged per call (max over ranks)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Fit:
    alpha_us: float
    beta_GBps: float | None  # None: time did not grow with size (no bandwidth term)
    points: int
    max_rel_err: float

    def predict_us(self, nbytes: float) -> float:
        return self.alpha_us + (nbytes / (self.beta_GBps * 1e3) if self.beta_GBps else 0.0)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def fit_alpha_beta(nbytes: list[float], seconds: list[float]) -> Fit:
    """Least squares for ``t = alpha + x/beta``, weighted by ``1/t²``; alpha clamped at >= 0."""
    pts = [(x, t) for x, t in zip(nbytes, seconds) if t > 0]
    if not pts:
        raise ValueError("fit_alpha_beta: no positive times")
    w = [1.0 / t**2 for _, t in pts]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, pts))
    st = sum(wi * t for wi, (_, t) in zip(w, pts))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, pts))
    sxt = sum(wi * x * t for wi, (x, t) in zip(w, pts))
    det = sw * sxx - sx * sx
    if len(pts) >= 2 and det > 1e-12 * sw * sxx:
        inv_beta = (sw * sxt - sx * st) / det
        alpha = (st - inv_beta * sx) / sw
    else:
        inv_beta, alpha = 0.0, st / sw
    if alpha < 0:  # a straight line through the origin
        alpha = 0.0
        inv_beta = sxt / sxx if sxx > 0 else 0.0
    if inv_beta <= 0:
        inv_beta, alpha = 0.0, st / sw
    rel = max(abs(alpha + inv_beta * x - t) / t for x, t in pts)
    beta = 1.0 / inv_beta / 1e9 if inv_beta > 0 else None
    return Fit(alpha * 1e6, beta, len(pts), rel)


def fit_rows(rows: list[Row]) -> dict[str, dict[str, Fit]]:
    """``{impl: {op: Fit}}`` over each (op, impl)'s sizes."""
    out: dict[str, dict[str, Fit]] = {}
    for impl in IMPLS:
        for op in BENCH_OPS:
            sel = [r for r in rows if r.op == op and r.impl == impl]
            if sel:
                out.setdefault(impl, {})[op] = fit_alpha_beta(
                    [r.bus_bytes for r in sel], [r.time_us * 1e-6 for r in sel])
    return out


# ----------------------------------------------------------------------------------------------
# measuring: every rank runs ``sweep`` with the same arguments


def _op_fn(op: str, impl: str, group: Any, count: int, dtype: Any, device: Any) -> Callable:
    import torch

    from . import ops, ring

    n = group.size
    if op == "all_reduce":
        x = torch.zeros(count, dtype=dtype, device=device)
        return (lambda: ops.all_reduce(x, group)) if impl == "backend" else (
            lambda: ring.ring_all_reduce(x, group))
    if op == "all_gather":
        x = torch.zeros(count // n, dtype=dtype, device=device)
        return (lambda: ops.all_gather(x, group)) if impl == "backend" else (
            lambda: ring.ring_all_gather(x, group))
    if op == "reduce_scatter":
        x = torch.zeros(count, dtype=dtype, device=device)
        return (lambda: ops.reduce_scatter(x, group)) if impl == "backend" else (
            lambda: ring.ring_reduce_scatter(x, group))
    if impl != "backend":
        raise ValueError(f"no {impl} implementation of {op}")
    x = torch.zeros(count, dtype=dtype, device=device)
    if op == "all_to_all":
        return lambda: ops.all_to_all(x, group)
    if op == "broadcast":
        return lambda: ops.broadcast(x, group, src=0)
    if op == "reduce":
        return lambda: ops.reduce(x, group, dst=0)
    if op == "scatter":  # S = the root's full buffer, n chunks of S/n
        out = torch.empty(count // n, dtype=dtype, device=device)
        chunks = list(x.chunk(n))
        return lambda: ops.scatter(chunks, out, group, src=0)
    if op == "gather":  # S = the gathered buffer on the root
        part = torch.zeros(count // n, dtype=dtype, device=device)
        return lambda: ops.gather(part, group, dst=0)
    if op == "sendrecv":
        buf = torch.empty_like(x)
        nxt, prv = (group.rank + 1) % n, (group.rank - 1) % n
        return lambda: ops.exchange(group, [(x, nxt)], [(buf, prv)])
    raise ValueError(f"unknown collective {op!r}")


def plan(ops_: list[str], impls: list[str]) -> list[tuple[str, str]]:
    """The (op, impl) pairs that exist, in sweep order."""
    return [(op, impl) for op in ops_ for impl in impls if impl == "backend" or op in RING_OPS]


def sweep(group: Any, traffic: Any, pairs: list[tuple[str, str]], sizes: list[int],
          dtype_name: str = "float32", iters: int = 20, warmup: int = 5, device: Any = None,
          on_point: Callable[[Row], None] | None = None) -> list[Row]:
    """Time every (op, impl) at every size on ``group``; every member calls it identically.

    Each timed iteration starts after a barrier; the iteration's time is the slowest member's,
    and a point's time is the median over iterations. The implementations of one collective
    (backend, ring) alternate iteration by iteration at each size, the order flipping each
    time, so that the machine's load falls on both alike. ``on_point`` sees each row as it is done.
    """
    import torch

    from . import ops

    dtype = getattr(torch, dtype_name)
    elem = torch.empty((), dtype=dtype).element_size()
    device = device or torch.device("cpu")
    quiet = replace(group, name="metrics", traffic=None)  # the bench's own bookkeeping
    n = group.size
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    impls_of: dict[str, list[str]] = {}
    for op, impl in pairs:
        impls_of.setdefault(op, []).append(impl)
    for op, impls in impls_of.items():
        vop = VOLUME_OP[op]
        for size in sizes:
            count = elements(op, size, elem, n)
            s_bytes = count * elem
            fns = {impl: _op_fn(op, impl, group, count, dtype, device) for impl in impls}
            per_call = {}
            for impl, fn in fns.items():
                for _ in range(warmup):
                    fn()
                sync()
                traffic.reset()
                fn()  # one untimed call: the bytes fived.comm's Traffic charges per call
                sync()
                rec = traffic.records.get((group.name, vop))
                per_call[impl] = rec.bytes / max(rec.calls, 1) if rec is not None else 0.0
            times: dict[str, list[float]] = {impl: [] for impl in impls}
            for it in range(iters):  # the implementations alternate, the order flips each time
                for impl in (impls if it % 2 == 0 else impls[::-1]):
                    ops.barrier(group)
                    t0 = time.perf_counter()
                    fns[impl]()
                    sync()
                    times[impl].append(time.perf_counter() - t0)
            for impl in impls:
                stats = torch.tensor(times[impl] + [per_call[impl]], dtype=torch.float64,
                                     device=device)
                ops.all_reduce(stats, quiet, op="max")
                stats = stats.cpu().tolist()
                t = statistics.median(stats[:-1])
                row = Row(op, impl, s_bytes, count, dtype_name, t * 1e6, algbw(s_bytes, t),
                          busbw(op, n, s_bytes, t), bus_bytes(op, s_bytes, n), stats[-1])
                rows.append(row)
                if on_point is not None:
                    on_point(row)
    traffic.reset()
    return rows


def result_dict(rows: list[Row], world: int, meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON document ``fived bench comm --json`` prints (schema in docs/comm.md)."""
    fits = fit_rows(rows)
    return {
        "schema": SCHEMA,
        "world": world,
        **meta,
        "rows": [r.as_dict() for r in rows],
        "fits": {op: f.as_dict() for op, f in fits.get("backend", {}).items()},
        "fits_by_impl": {impl: {op: f.as_dict() for op, f in d.items()} for impl, d in fits.items()},
    }
