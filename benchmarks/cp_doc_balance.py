"""Context-parallel balance under document masks (issue 41): per-rank attention work of the
zigzag ring vs the document-aware balancers torch ships, on packed windows of a document-length
mix.

The mix: document lengths (tokens) drawn from a lognormal with median ``--median`` and σ
``--sigma`` (web-text-like: heavy-tailed, most documents short, a few longer than a window),
concatenated into one stream and cut into windows of ``--seq`` tokens as ``fived.data.loader``
cuts them (a window starts mid-document). Per window and cp rank:

* ``pairs`` — the (q, k) pairs its queries see (an ideal kernel's work, ``rank_work``);
* ``blocks`` — for zigzag, the c × c chunk pairs the ring computes (``ring_chunk_pairs``; the
  runtime's ``doc_plan`` skips the others).

Imbalance = max over ranks / mean over ranks, per window, then averaged over the windows (and
the worst window). A step waits for its slowest rank, so max/mean is the step's slowdown.

    PYTHONPATH=. python benchmarks/cp_doc_balance.py [--seq 8192] [--cp 4 8] [--windows 64]
    PYTHONPATH=. python benchmarks/cp_doc_balance.py --runtime --seq 2048 --cp 4 --windows 4

``--runtime``: the ring itself on ``cp`` gloo ranks (batch 1, 4/2 heads of dim 16), forward
and backward, zigzag and ``--cp-balance ptrr``: each rank's executed FLOPs as the kernels
count them (``AttentionStats``: every c × c chunk pair computed, masked or not) — the block
work a rank really does, coarser than the ideal ``pairs``; and the largest output difference
between the two shardings (both exact).
"""

from __future__ import annotations

import argparse
import random
import statistics

from fived.ledger.context import rank_work, ring_chunk_pairs, token_ranks


def windows(seq: int, count: int, median: float, sigma: float, seed: int) -> list[list[int]]:
    """``count`` windows of ``seq`` tokens, each as the lengths of the document pieces it holds."""
    rng = random.Random(seed)
    out, cur, room = [], [], seq
    carry = 0
    while len(out) < count:
        L = carry or max(1, int(rng.lognormvariate(0.0, sigma) * median))
        carry = 0
        if L >= room:
            cur.append(room)
            carry = L - room
            out.append(cur)
            cur, room = [], seq
        else:
            cur.append(L)
            room -= L
    return out


def imbalance(work: list[float]) -> float:
    return max(work) / (sum(work) / len(work))


def _ring_rank(rank: int, world: int, ws: list[list[int]]) -> list[dict]:
    import torch
    import torch.distributed as dist

    from fived.parallel import context
    from fived.ranks.grid import DimGroup

    group = DimGroup("cp", tuple(range(world)), rank, dist.group.WORLD, None)
    out = []
    for w in ws:
        S = sum(w)
        docs = torch.repeat_interleave(torch.arange(len(w)), torch.tensor(w))[None]
        g = torch.Generator().manual_seed(1)
        full = [torch.randn(1, S, x, 16, generator=g) for x in (4, 2, 2)]
        rec = {}
        for bal in ("zigzag", "ptrr"):
            pos = (context.balanced_positions(docs, world, rank)[0] if bal == "ptrr"
                   else context.shard_positions(S, world, rank))
            q, k, v = (x[:, pos].clone().requires_grad_(True) for x in full)
            stats = context.AttentionStats()
            o = context.ring_attention(q, k, v, group, stats=stats, docs=docs, balance=bal)
            o.square().sum().backward()
            flops = torch.zeros(world, dtype=torch.float64)
            flops[rank] = stats.flops
            dist.all_reduce(flops)
            whole = torch.zeros(1, S, 4, 16)
            whole[:, pos] = o.detach()
            dist.all_reduce(whole)
            rec[bal] = (flops.tolist(), whole)
        out.append({b: f for b, (f, _) in rec.items()}
                   | {"diff": float((rec["zigzag"][1] - rec["ptrr"][1]).abs().max())})
    return out


def runtime(a: argparse.Namespace, ws: list[list[int]]) -> None:
    from fived.testing import run_ranks

    for n in a.cp:
        res = run_ranks(_ring_rank, n, ws, timeout=1800)[0]
        for i, r in enumerate(res):
            z, p = imbalance(r["zigzag"]), imbalance(r["ptrr"])
            print(f"cp {n} window {i}: executed FLOPs max/mean zigzag {z:.3f}, ptrr {p:.3f}; "
                  f"total ptrr/zigzag {sum(r['ptrr']) / sum(r['zigzag']):.3f}; "
                  f"outputs differ by {r['diff']:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cp", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--median", type=float, default=512.0)
    ap.add_argument("--sigma", type=float, default=1.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runtime", action="store_true")
    a = ap.parse_args()
    ws = windows(a.seq, a.windows, a.median, a.sigma, a.seed)
    if a.runtime:
        return runtime(a, ws)
    docs = [len(w) for w in ws]
    print(f"seq {a.seq}, {a.windows} windows, document lengths lognormal(median {a.median:g}, "
          f"σ {a.sigma}): {statistics.mean(docs):.1f} document pieces per window")
    print(f"{'cp':>3} {'balancer':>13} {'metric':>7} {'mean max/mean':>14} {'worst':>7}")
    for n in a.cp:
        rows = {}
        for bal in ("zigzag", "ptrr", "doc-headtail"):
            rows[(bal, "pairs")] = [imbalance(rank_work(w, token_ranks(w, n, bal), n))
                                   for w in ws]
        rows[("zigzag", "blocks")] = [imbalance(ring_chunk_pairs(w, n)) for w in ws]
        for (bal, metric), v in rows.items():
            print(f"{n:>3} {bal:>13} {metric:>7} {statistics.mean(v):>14.3f} {max(v):>7.3f}")


if __name__ == "__main__":
    main()
