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
"""

from __future__ import annotations

import argparse
import random
import statistics

from fived.ledger.context import ring_chunk_pairs, rank_work, token_ranks


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cp", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--median", type=float, default=512.0)
    ap.add_argument("--sigma", type=float, default=1.2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    ws = windows(a.seq, a.windows, a.median, a.sigma, a.seed)
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
