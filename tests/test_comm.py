"""fived.comm: every op against a direct computation, its Traffic bytes, the autograd regions'
backward against one rank, the ring collectives against the backend's, and `fived bench comm`.

Each world size runs every rank-side check in *one* spawn (``_suite``); the checks report
failures by name and each one is its own pytest item.
"""

from __future__ import annotations

import json
import math
import traceback

import pytest
import torch

from fived.comm import autograd, bench, ops, ring
from fived.comm.volume import bytes_sent
from fived.config import ParallelConfig
from fived.ranks.grid import Grid
from fived.testing import run_ranks

CHECKS: dict[str, object] = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def data(who: int, shape, dtype=torch.float32, ints: bool = False, salt: int = 0) -> torch.Tensor:
    """Rank ``who``'s deterministic input: every rank can rebuild every other rank's."""
    g = torch.Generator().manual_seed(7919 * salt + who)
    if ints:  # small integers: every sum order gives the same result, in bf16 too
        return torch.randint(-8, 9, tuple(shape), generator=g).to(dtype)
    return torch.randn(tuple(shape), generator=g).to(dtype)


def nb(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def recorded(traffic, op: str, name: str = "dp") -> tuple[int, float]:
    r = traffic.records.get((name, op))
    return (0, 0.0) if r is None else (r.calls, r.bytes)


def assert_bytes(traffic, op: str, expect: float, calls: int = 1) -> None:
    got = recorded(traffic, op)
    assert got == (calls, expect), f"{op}: recorded (calls, bytes) {got}, expected {(calls, expect)}"


# ------------------------------------------------------------------------------- ops vs direct
@check
def all_reduce_ops(g, traffic, me, n):
    for op, red in (("sum", lambda xs: sum(xs)), ("max", lambda xs: torch.stack(xs).amax(0)),
                    ("min", lambda xs: torch.stack(xs).amin(0))):
        traffic.reset()
        x = data(me, (5, 3))
        ops.all_reduce(x, g, op=op)
        torch.testing.assert_close(x, red([data(j, (5, 3)) for j in range(n)]))
        assert_bytes(traffic, "all_reduce", 2 * (n - 1) / n * nb(x))
    traffic.reset()
    x = data(me, (7,), torch.bfloat16, ints=True)
    h = ops.all_reduce(x, g, async_op=True)
    assert h.wait() is x
    assert torch.equal(x, sum(data(j, (7,), torch.bfloat16, ints=True) for j in range(n)))
    assert_bytes(traffic, "all_reduce", bytes_sent("all_reduce", nb(x), n))


@check
def all_gather_ops(g, traffic, me, n):
    for dim, shape in ((0, (3, 4)), (1, (2, 3, 5)), (2, (2, 3, 5)), (-1, (4, 3))):
        traffic.reset()
        x = data(me, shape)
        out = ops.all_gather(x, g, dim=dim)
        torch.testing.assert_close(out, torch.cat([data(j, shape) for j in range(n)], dim=dim),
                                   rtol=0, atol=0)
        assert_bytes(traffic, "all_gather", (n - 1) / n * nb(out))
    traffic.reset()
    x = data(me, (6,))
    out = torch.empty(6 * n)
    assert ops.all_gather_into(out, x, g) is out
    assert torch.equal(out, torch.cat([data(j, (6,)) for j in range(n)]))
    h = ops.all_gather(x, g, async_op=True)
    assert torch.equal(h.wait(), out)
    assert_bytes(traffic, "all_gather", 2 * (n - 1) / n * nb(out), calls=2)


@check
def reduce_scatter_ops(g, traffic, me, n):
    for dim, shape in ((0, (2 * n, 3)), (1, (3, 2 * n, 2)), (-1, (3, n))):
        traffic.reset()
        x = data(me, shape)
        out = ops.reduce_scatter(x, g, dim=dim)
        full = sum(data(j, shape) for j in range(n))
        torch.testing.assert_close(out, full.chunk(n, dim=dim)[me])
        assert_bytes(traffic, "reduce_scatter", (n - 1) / n * nb(x))
    x = data(me, (3 * n,))
    buf = torch.empty(3)
    assert ops.reduce_scatter(x, g, op="max", out=buf) is buf
    torch.testing.assert_close(buf, torch.stack([data(j, (3 * n,)) for j in range(n)]).amax(0)
                               .chunk(n)[me])
    h = ops.reduce_scatter(x, g, async_op=True)
    torch.testing.assert_close(h.wait(), sum(data(j, (3 * n,)) for j in range(n)).chunk(n)[me])
    with pytest.raises(ValueError, match="not divisible"):
        ops.reduce_scatter(data(me, (n + 1, 2)), g)


def _splits(n: int) -> list[list[int]]:
    """splits[src][dst]: rows rank src sends to rank dst (uneven, some zero)."""
    return [[(src + 2 * dst) % 3 for dst in range(n)] for src in range(n)]


@check
def all_to_all_ops(g, traffic, me, n):
    x = data(me, (2 * n, 3))  # even: two rows to every rank
    out = ops.all_to_all(x, g)
    expect = torch.cat([data(j, (2 * n, 3)).chunk(n)[me] for j in range(n)])
    assert torch.equal(out, expect)
    assert_bytes(traffic, "all_to_all", (n - 1) / n * nb(x))
    traffic.reset()
    sp = _splits(n)
    ins, outs = sp[me], [sp[j][me] for j in range(n)]
    x = data(me, (sum(ins), 2), salt=1)
    h = ops.all_to_all(x, g, ins, outs, async_op=True)
    out = h.wait()
    parts = [data(j, (sum(sp[j]), 2), salt=1).split(sp[j])[me] for j in range(n)]
    assert torch.equal(out, torch.cat(parts))
    assert_bytes(traffic, "all_to_all", float((sum(ins) - ins[me]) * 2 * 4))


@check
def broadcast_reduce_ops(g, traffic, me, n):
    src = n - 1
    x = data(me, (4, 2))
    ops.broadcast(x, g, src=src)
    assert torch.equal(x, data(src, (4, 2)))
    assert_bytes(traffic, "broadcast", float(nb(x)) if me == src else 0.0)
    dst = 1
    x = data(me, (5,))
    ops.reduce(x, g, dst=dst)
    if me == dst:
        torch.testing.assert_close(x, sum(data(j, (5,)) for j in range(n)))
    assert_bytes(traffic, "reduce", 0.0 if me == dst else float(nb(x)))


@check
def scatter_gather_ops(g, traffic, me, n):
    src = 0
    chunks = list(data(src, (n, 3)).unbind(0)) if me == src else None
    out = torch.empty(3)
    ops.scatter(chunks, out, g, src=src)
    assert torch.equal(out, data(src, (n, 3))[me])
    assert_bytes(traffic, "scatter", (n - 1) * nb(out) if me == src else 0.0)
    dst = n - 1
    x = data(me, (2, 2))
    got = ops.gather(x, g, dst=dst)
    if me == dst:
        assert len(got) == n and all(torch.equal(got[j], data(j, (2, 2))) for j in range(n))
    else:
        assert got is None
    assert_bytes(traffic, "gather", 0.0 if me == dst else float(nb(x)))


@check
def send_recv_ops(g, traffic, me, n):
    # pairs (0,1), (2,3): evens send first, then the other way
    peer = me ^ 1
    x, buf = data(me, (3, 3)), torch.empty(3, 3)
    if me % 2 == 0:
        ops.send(x, g, peer)
        ops.recv(buf, g, peer)
    else:
        ops.recv(buf, g, peer)
        ops.send(x, g, peer)
    assert torch.equal(buf, data(peer, (3, 3)))
    assert_bytes(traffic, "send", float(nb(x)))
    assert_bytes(traffic, "recv", 0.0)


@check
def exchange_ops(g, traffic, me, n):
    nxt, prv = (me + 1) % n, (me - 1) % n
    x = data(me, (4,))
    a, b = torch.empty(4), torch.empty(4)
    ops.exchange(g, [(x, nxt)], [(a, prv)])
    assert torch.equal(a, data(prv, (4,)))
    assert_bytes(traffic, "send", float(nb(x)))
    traffic.reset()  # both directions at once (ring attention's pattern), asynchronously
    y = data(me, (2, 3), salt=2)
    a, b = torch.empty(2, 3), torch.empty(2, 3)
    h = ops.exchange(g, [(y, nxt), (y, prv)], [(a, prv), (b, nxt)], async_op=True)
    h.wait()
    assert torch.equal(a, data(prv, (2, 3), salt=2)) and torch.equal(b, data(nxt, (2, 3), salt=2))
    assert_bytes(traffic, "send", 2.0 * nb(y))
    assert ops.exchange(g, [], []) is None


@check
def one_member_group_records_nothing(g, traffic, me, n):
    solo = g.grid_solo  # the rank's tp group: one member, Traffic bound
    assert solo.size == 1 and solo.traffic is traffic
    x = data(me, (4, 2))
    assert ops.all_reduce(x.clone(), solo).equal(x)
    assert ops.all_reduce(x.clone(), solo, async_op=True).wait().equal(x)
    assert ops.all_gather(x, solo, dim=1).equal(x)
    out = torch.empty(8)
    assert ops.all_gather_into(out, x.reshape(-1), solo).equal(x.reshape(-1))
    assert ops.reduce_scatter(x, solo, dim=1).equal(x)
    buf = torch.empty(4, 2)
    assert ops.reduce_scatter(x, solo, out=buf).equal(x)
    assert ops.all_to_all(x, solo).equal(x)
    assert ops.all_to_all(x, solo, [4], [4], async_op=True).wait().equal(x)
    assert ops.broadcast(x.clone(), solo).equal(x)
    assert ops.reduce(x.clone(), solo).equal(x)
    out = torch.empty(4, 2)
    assert ops.scatter([x], out, solo).equal(x)
    assert ops.gather(x, solo)[0].equal(x)
    assert ops.exchange(solo, [], []) is None
    assert ring.ring_all_reduce(x.clone(), solo).equal(x)
    assert ring.ring_all_gather(x, solo).equal(x)
    assert ring.ring_reduce_scatter(x, solo).equal(x)
    for fn in (autograd.copy_to, autograd.reduce_from):
        assert fn(x, solo) is x
    for fn in (autograd.gather_from, autograd.scatter_to, autograd.split_to, autograd.gather_to):
        assert fn(x, solo, 0) is x
    assert autograd.all_to_all(x, solo) is x
    assert not traffic.records, dict(traffic.records)


# ------------------------------------------------------------------ autograd vs one rank
def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_(True)


@check
def tp_copy_to_reduce_from_backward(g, traffic, me, n):
    """Column-parallel W then row-parallel V: out = reduce_from(copy_to(x) @ W_r @ V_r) = x W V."""
    X, W, V, G = data(0, (3, 4), salt=3), data(1, (4, 2 * n), salt=3), data(2, (2 * n, 5), salt=3), \
        data(3, (3, 5), salt=3)
    x, w, v = _leaf(X), _leaf(W.chunk(n, 1)[me]), _leaf(V.chunk(n, 0)[me])
    out = autograd.reduce_from(autograd.copy_to(x, g) @ w @ v, g)
    (out * G).sum().backward()
    rx, rw, rv = _leaf(X), _leaf(W), _leaf(V)
    ref = rx @ rw @ rv
    (ref * G).sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, rx.grad)
    torch.testing.assert_close(w.grad, rw.grad.chunk(n, 1)[me])
    torch.testing.assert_close(v.grad, rv.grad.chunk(n, 0)[me])
    # forward all-reduce of the output (3x5) and backward all-reduce of x's grad (3x4)
    assert_bytes(traffic, "all_reduce", bytes_sent("all_reduce", 15 * 4, n)
                 + bytes_sent("all_reduce", 12 * 4, n), calls=2)


@check
def sp_gather_from_scatter_to_backward(g, traffic, me, n):
    """Sequence-parallel: x sharded on dim 1; gather, column W, row V, reduce-scatter on dim 1."""
    S = 2 * n
    X, W, V, G = data(0, (2, S, 3), salt=4), data(1, (3, 2 * n), salt=4), \
        data(2, (2 * n, 3), salt=4), data(3, (2, S, 3), salt=4)
    x, w, v = _leaf(X.chunk(n, 1)[me]), _leaf(W.chunk(n, 1)[me]), _leaf(V.chunk(n, 0)[me])
    out = autograd.scatter_to(autograd.gather_from(x, g, 1) @ w @ v, g, 1)
    (out * G.chunk(n, 1)[me]).sum().backward()
    rx, rw, rv = _leaf(X), _leaf(W), _leaf(V)
    ref = rx @ rw @ rv
    (ref * G).sum().backward()
    torch.testing.assert_close(out, ref.chunk(n, 1)[me])
    torch.testing.assert_close(x.grad, rx.grad.chunk(n, 1)[me])
    torch.testing.assert_close(w.grad, rw.grad.chunk(n, 1)[me])
    torch.testing.assert_close(v.grad, rv.grad.chunk(n, 0)[me])
    full = 2 * S * 3 * 4  # every collective here moves a (2, S, 3) fp32 tensor
    assert recorded(traffic, "all_gather") == (2, 2 * bytes_sent("all_gather", full, n))
    assert recorded(traffic, "reduce_scatter") == (2, 2 * bytes_sent("reduce_scatter", full, n))


@check
def split_to_gather_to_backward(g, traffic, me, n):
    X, G = data(0, (2 * n, 3), salt=5), data(1, (2 * n, 3), salt=5)
    x = _leaf(X)
    s = autograd.split_to(x, g, 0)
    out = autograd.gather_to(s * s + 2 * s, g, 0)
    (out * G).sum().backward()
    rx = _leaf(X)
    ((rx * rx + 2 * rx) * G).sum().backward()
    torch.testing.assert_close(out, rx * rx + 2 * rx)
    torch.testing.assert_close(x.grad, rx.grad)


@check
def all_to_all_backward(g, traffic, me, n):
    """Dispatch rows to ranks, scale by (dst+1) there, combine back: grad = G·(dst+1) per row."""
    for uneven in (False, True):
        traffic.reset()
        sp = _splits(n) if uneven else [[2] * n for _ in range(n)]
        ins, outs = sp[me], [sp[j][me] for j in range(n)]
        X, G = data(me, (sum(ins), 3), salt=6), data(me, (sum(ins), 3), salt=7)
        x = _leaf(X)
        y = autograd.all_to_all(x, g, ins, outs) * (me + 1)
        back = autograd.all_to_all(y, g, outs, ins)
        (back * G).sum().backward()
        scale = torch.cat([torch.full((k, 1), float(d + 1)) for d, k in enumerate(ins)])
        torch.testing.assert_close(back, X * scale)
        torch.testing.assert_close(x.grad, G * scale)
        sent_fwd = (sum(ins) - ins[me]) * 12 + (sum(outs) - outs[me]) * 12
        assert recorded(traffic, "all_to_all") == (4, 2.0 * sent_fwd)


# ------------------------------------------------------------------ ring vs the backend
RING_SHAPES = [(1,), (7,), (13,), (4, 5), (1000,), (4099,)]


def _ring_pad(rows: int, row_bytes: int, n: int) -> float:
    """Bytes the padding rows add to one member's reduce-scatter phase."""
    c = -(-rows // n)
    return (n - 1) * (c * row_bytes) - bytes_sent("reduce_scatter", rows * row_bytes, n)


@check
def ring_all_reduce_matches_backend(g, traffic, me, n):
    for dtype in (torch.float32, torch.bfloat16):
        for shape in RING_SHAPES:
            for ints in (True, False):
                x = data(me, shape, dtype, ints=ints, salt=8)
                traffic.reset()
                mine = ring.ring_all_reduce(x.clone(), g)
                ring_bytes = recorded(traffic, "all_reduce")
                traffic.reset()
                theirs = ops.all_reduce(x.clone(), g)
                if ints:  # exact: small integers sum exactly in any order
                    assert torch.equal(mine, theirs), (dtype, shape)
                else:
                    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else \
                        dict(rtol=2e-2, atol=5e-2)
                    torch.testing.assert_close(mine, theirs, **tol)
                numel, el = x.numel(), x.element_size()
                # no padding: chunks of ⌊numel/n⌋ or ⌈numel/n⌉ (tensor_split); a member sends
                # every chunk but its own in the reduce-scatter and all but its successor's
                # in the all-gather — 2(n−1)/n·S exactly when n divides numel
                c = [len(p) for p in torch.arange(numel).tensor_split(n)]
                expect = float((2 * numel - c[me] - c[(me + 1) % n]) * el)
                assert ring_bytes == (1, expect), (shape, ring_bytes, expect)
                if numel % n == 0:
                    assert ring_bytes == recorded(traffic, "all_reduce")
    for op in ("max", "min"):
        x = data(me, (11,), salt=9)
        theirs = ops.all_reduce(x.clone(), g, op=op)
        assert torch.equal(ring.ring_all_reduce(x.clone(), g, op=op), theirs)
    x = data(me, (6, 4), salt=10).t()  # non-contiguous, reduced in place
    y = x.clone()
    ring.ring_all_reduce(x, g)
    ops.all_reduce(y, g)
    torch.testing.assert_close(x, y)


@check
def ring_reduce_scatter_matches_backend(g, traffic, me, n):
    for dtype in (torch.float32, torch.bfloat16):
        for dim, shape in ((0, (3 * n,)), (0, (2 * n, 3)), (1, (3, 2 * n, 2)), (-1, (2, n))):
            x = data(me, shape, dtype, ints=True, salt=11)
            traffic.reset()
            mine = ring.ring_reduce_scatter(x, g, dim=dim)
            ring_bytes = recorded(traffic, "reduce_scatter")
            traffic.reset()
            theirs = ops.reduce_scatter(x, g, dim=dim)
            assert mine.shape == theirs.shape and torch.equal(mine, theirs), (dtype, dim, shape)
            assert ring_bytes == recorded(traffic, "reduce_scatter") == \
                (1, bytes_sent("reduce_scatter", nb(x), n))
    # lengths the backend refuses: member m gets rows [m·c, min((m+1)·c, R)), c = ceil(R/n)
    for dim, shape in ((0, (2 * n + 1,)), (0, (n + 1, 3)), (1, (2, 5, 3)), (0, (1,))):
        x = data(me, shape, salt=12)
        traffic.reset()
        mine = ring.ring_reduce_scatter(x, g, dim=dim)
        full = sum(data(j, shape, salt=12) for j in range(n))
        rows, c = shape[dim], -(-shape[dim] // n)
        lo, hi = min(me * c, rows), min((me + 1) * c, rows)
        torch.testing.assert_close(mine, full.narrow(dim, lo, hi - lo))
        row_bytes = nb(x) // rows
        assert recorded(traffic, "reduce_scatter") == (
            1, bytes_sent("reduce_scatter", nb(x), n) + _ring_pad(rows, row_bytes, n))
    x = data(me, (n, 2), salt=13)
    torch.testing.assert_close(ring.ring_reduce_scatter(x, g, op="max"),
                               torch.stack([data(j, (n, 2), salt=13) for j in range(n)]).amax(0)[me:me + 1])


@check
def ring_all_gather_matches_backend(g, traffic, me, n):
    for dtype in (torch.float32, torch.bfloat16):
        for dim, shape in ((0, (1,)), (0, (7,)), (0, (3, 5)), (1, (2, 3, 4)), (-1, (3, 1)),
                           (0, (1001,))):
            x = data(me, shape, dtype, salt=14)
            traffic.reset()
            mine = ring.ring_all_gather(x, g, dim=dim)
            ring_bytes = recorded(traffic, "all_gather")
            traffic.reset()
            theirs = ops.all_gather(x, g, dim=dim)
            assert mine.shape == theirs.shape and torch.equal(mine, theirs), (dtype, dim, shape)
            assert ring_bytes == recorded(traffic, "all_gather") == \
                (1, bytes_sent("all_gather", n * nb(x), n))


@check
def ring_record_as_and_metrics(g, traffic, me, n):
    x = data(me, (8,))
    ring.ring_all_reduce(x, g, record_as="ring_all_reduce")
    assert set(traffic.records) == {("dp", "ring_all_reduce")}
    from dataclasses import replace

    traffic.reset()
    ring.ring_all_gather(x, replace(g, traffic=None))
    assert not traffic.records


@check
def small_sum_position_free(g, traffic, me, n):
    """A float64 element of a small all-reduce gets the same bits whatever its position and
    the vector's length: what lets the trainer carry the clip's Σg² in the loss all-reduce
    (``Trainer.norm_rides_loss``) bit for bit. The data are order-sensitive (mixed
    magnitudes): some trial's sum differs between two orders of the ranks, so a collective
    adding another order for another position would fail this."""
    sensitive = False
    for trial in range(200):
        vals = [data(r, (3,), torch.float64, salt=trial) * 10.0 ** ((trial * 7 + r * 3) % 17 - 8)
                for r in range(n)]
        v = vals[me]
        a, b, c = v[:1].clone(), v.clone(), v[[1, 0, 2]].clone()
        for t in (a, b, c):
            ops.all_reduce(t, g)
        assert a[0].item() == b[0].item() == c[1].item(), (trial, a[0].item(), b[0].item(),
                                                              c[1].item())
        x = [float(w[0]) for w in vals]
        fwd = bwd = 0.0
        for y in x:
            fwd += y
        for y in reversed(x):
            bwd += y
        sensitive |= fwd != bwd
    assert sensitive or n == 2  # two addends: a + b is b + a in IEEE


# ------------------------------------------------------------------ the harness
RING_CHECKS = [k for k in CHECKS if k.startswith("ring_")]
WORLDS = {2: list(CHECKS), 4: list(CHECKS), 3: RING_CHECKS + ["all_to_all_ops", "all_gather_ops",
                                                                "all_to_all_backward",
                                                                "small_sum_position_free"]}


def _run_checks(g, solo, traffic, names: list[str]) -> dict[str, str | None]:
    object.__setattr__(g, "grid_solo", solo)
    out: dict[str, str | None] = {}
    for name in names:
        traffic.reset()
        try:
            CHECKS[name](g, traffic, g.rank, g.size)
            out[name] = None
        except AssertionError:  # local comparisons only: every rank ran the same collectives
            out[name] = traceback.format_exc()
        ops.barrier(g)
    return out


def _suite(rank: int, world: int) -> dict[int, dict[str, str | None]]:
    """On 4 ranks: the checks on a 4-member group (the world), on 2-member groups (dp of a
    dp2·tp2 grid: members {0,2} and {1,3}, so group-to-global rank mapping is exercised) and on a
    3-member group {0,1,2} (sizes that do not divide). One spawn keeps the suite fast."""
    import torch.distributed as dist

    from fived.comm.ops import Traffic
    from fived.ranks.grid import DimGroup

    assert world == 4
    out = {}
    t4 = Traffic()
    grid4 = Grid.from_config(ParallelConfig(dp=4), rank).connect(t4)
    out[4] = _run_checks(grid4["dp"], grid4["pp"], t4, WORLDS[4])
    t2 = Traffic()
    grid2 = Grid.from_config(ParallelConfig(dp=2, tp=2), rank).connect(t2)
    assert grid2["dp"].ranks == ((0, 2) if rank % 2 == 0 else (1, 3))
    out[2] = _run_checks(grid2["dp"], grid2["pp"], t2, WORLDS[2])
    pg3 = dist.new_group([0, 1, 2])
    if rank < 3:
        t3 = Traffic()
        g3 = DimGroup("dp", (0, 1, 2), rank, pg3, t3)
        out[3] = _run_checks(g3, DimGroup("pp", (rank,), 0, None, t3), t3, WORLDS[3])
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def suite() -> list[dict[int, dict[str, str | None]]]:
    return run_ranks(_suite, 4, timeout=180)


@pytest.mark.parametrize("world,name", [(w, k) for w in (2, 4, 3) for k in WORLDS[w]])
def test_comm(suite, world, name):
    for rank, res in enumerate(suite):
        if world in res:
            assert res[world][name] is None, f"rank {rank}, {world}-member group:\n{res[world][name]}"


# ------------------------------------------------------------------ bench arithmetic and CLI
def test_sizes_and_units():
    assert bench.parse_size("1K") == 1024 and bench.parse_size("16M") == 16 << 20
    assert bench.parse_size("512") == 512 and bench.parse_size("1g") == 1 << 30
    assert bench.size_sweep(1024, 16 << 20, 2)[-1] == 16 << 20
    assert len(bench.size_sweep(1024, 16 << 20, 2)) == 15
    assert bench.size_sweep(1024, 4096, 4) == [1024, 4096]
    with pytest.raises(ValueError):
        bench.parse_size("lots")
    assert bench.elements("all_gather", 1000, 4, 3) == 249
    assert bench.canonical_op("send") == "sendrecv"


def test_busbw_factors_match_nccl_tests():
    t = 1e-3
    assert bench.algbw(1e9, 1.0) == 1.0
    assert bench.busbw("all_reduce", 4, 1e6, t) == pytest.approx(1.0 * 2 * 3 / 4)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bench.busbw(op, 4, 1e6, t) == pytest.approx(0.75)
    for op in ("broadcast", "reduce", "sendrecv"):
        assert bench.busbw(op, 4, 1e6, t) == pytest.approx(1.0)


def test_alpha_beta_fit_recovers_a_line():
    xs = [2.0**k for k in range(10, 25)]
    ts = [30e-6 + x / 2e9 for x in xs]
    f = bench.fit_alpha_beta(xs, ts)
    assert f.alpha_us == pytest.approx(30.0, rel=1e-6) and f.beta_GBps == pytest.approx(2.0, rel=1e-6)
    assert f.max_rel_err < 1e-9 and f.predict_us(1e6) == pytest.approx(30 + 500)
    flat = bench.fit_alpha_beta([1.0, 2.0, 4.0], [1e-4, 1e-4, 1e-4])
    assert flat.beta_GBps is None and flat.alpha_us == pytest.approx(100.0)
    origin = bench.fit_alpha_beta([1e6, 2e6], [1e-3, 2.2e-3])  # negative intercept -> through 0
    assert origin.alpha_us == 0.0 and origin.beta_GBps > 0


def test_bench_comm_cli_json(tmp_path, capsys):
    from fived.bench.comm import main

    out = tmp_path / "comm.json"
    rc = main(["--nprocs", "2", "-b", "1K", "-e", "4K", "-f", "4", "--iters", "2", "--warmup", "1",
               "--json", "--out", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    doc = json.loads(printed)
    assert doc == json.loads(out.read_text())
    from fived.bench import schema

    schema.validate(doc)  # the fived.bench document; the sweep is in its extras
    doc = {**doc["extra"], "rows": [r["extra"] for r in doc["rows"]]}
    assert doc["schema"] == bench.SCHEMA and doc["world"] == 2 and doc["backend"] == "gloo"
    have = {(r["op"], r["impl"]) for r in doc["rows"]}
    assert have == set(bench.plan(list(bench.BENCH_OPS), list(bench.IMPLS)))
    for r in doc["rows"]:
        assert r["size_bytes"] in (1024, 4096) and r["busbw_GBps"] > 0 and math.isfinite(r["time_us"])
        assert r["busbw_GBps"] == pytest.approx(
            r["algbw_GBps"] * bench.busbw_factor(bench.VOLUME_OP[r["op"]], 2))
        # what fived.comm's Traffic charged per call is the volume formula (max over ranks)
        assert r["recorded_bytes"] == r["bus_bytes"], r
    for op in bench.BENCH_OPS:
        assert set(doc["fits"][op]) >= {"alpha_us", "beta_GBps"}
    assert set(doc["fits_by_impl"]["ring"]) == set(bench.RING_OPS)


def test_bench_comm_rejects_bad_flags(capsys):
    from fived.bench.comm import main

    assert main(["--ops", "all_reduce,bogus"]) == 2
    assert main(["--ops", "broadcast", "--impl", "ring"]) == 2
    assert main(["--nprocs", "1"]) == 2
    assert "bogus" in capsys.readouterr().err


def _ring_large(rank: int, world: int) -> None:
    from fived.comm.ops import Traffic

    traffic = Traffic()
    g = Grid.from_config(ParallelConfig(dp=world), rank).connect(traffic)["dp"]
    for dtype in (torch.float32, torch.bfloat16):
        for numel in ((1 << 20) + 3, 3 << 20):
            x = data(rank, (numel,), dtype, ints=True, salt=20)
            assert torch.equal(ring.ring_all_reduce(x.clone(), g), ops.all_reduce(x.clone(), g))
            assert torch.equal(ring.ring_all_gather(x, g), ops.all_gather(x, g))
            if numel % world == 0:
                assert torch.equal(ring.ring_reduce_scatter(x, g), ops.reduce_scatter(x, g))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ring_large_buffers(world):
    run_ranks(_ring_large, world, timeout=600)
