"""Context parallelism as arithmetic: zigzag chunks, the ring's block plan, bytes and FLOPs.

Torch-free (like ``fived.comm.volume``) so the ledger can import it for clusters that are not
here; ``fived.parallel.context`` runs exactly this plan and the tests check the runtime's
measured bytes, saved activations and executed FLOPs against these functions.

Per layer and cp rank, with b sequences, S/cp local tokens, h/g local (tp-cut) query/kv heads,
head_dim d and e bytes per element, B_kv = 2·b·(S/cp)·g·d·e one K/V block:

* ring traffic: forward (cp−1)·B_kv; backward (cp−1)·B_kv of K/V + (cp−1)·B_kv of dK/dV;
* Ulysses traffic: (cp−1)/cp · b·(S/cp)·d·e·(2h + 2g′) per direction (q, k′, v′, out), g′ the
  kv heads after replication (``ulysses_kv_heads``);
* ring activations: b·(S/cp)·[4·d·(h + 2g) + e·d·h + 4·h] (q and K/V in fp32, out, fp32 lse);
* ring FLOPs per rank: 4·b·h·c²·d per chunk pair the plan computes, c = S/(2·cp).
"""

from __future__ import annotations

LAYOUTS = ("zigzag", "contiguous")


def chunk_ids(rank: int, n: int, layout: str = "zigzag") -> tuple[int, int]:
    """The two global chunk indices (of 2·n) that cp rank ``rank`` holds."""
    if layout == "zigzag":
        return rank, 2 * n - 1 - rank
    if layout == "contiguous":
        return 2 * rank, 2 * rank + 1
    raise ValueError(f"unknown cp layout {layout!r}; choose one of {LAYOUTS}")


def positions(seq_len: int, n: int, rank: int, layout: str = "zigzag") -> list[int]:
    """Global token positions held by cp rank ``rank`` (S/n of them, in local order): its two
    chunks of S/(2·n) (``chunk_ids``); a ValueError unless 2·n divides S."""
    if seq_len % (2 * n):
        raise ValueError(f"seq_len {seq_len} is not divisible by 2·cp = {2 * n} (zigzag)")
    c = seq_len // (2 * n)
    return [i for g in chunk_ids(rank, n, layout) for i in range(g * c, (g + 1) * c)]


def step_plan(q_chunks: tuple[int, int], kv_chunks: tuple[int, int], c: int
              ) -> list[tuple[slice, list[int], bool, int]]:
    """The attention calls of the local q chunks against one K/V block; masked pairs skipped.

    Returns (q rows, kv local chunk indices, causal, chunk pairs) per call: a K/V chunk before
    the q chunk is attended whole, the same chunk causally (the diagonal), a later one not at
    all. Query chunks that see the same earlier K/V chunks share one call.
    """
    full = [[j for j, kc in enumerate(kv_chunks) if kc < qc] for qc in q_chunks]
    diag = [[j for j, kc in enumerate(kv_chunks) if kc == qc] for qc in q_chunks]
    if full[0] and full[0] == full[1] and not (diag[0] or diag[1]):
        return [(slice(0, 2 * c), full[0], False, 2 * len(full[0]))]
    calls = []
    for a in range(len(q_chunks)):
        rows = slice(a * c, (a + 1) * c)
        if full[a]:
            calls.append((rows, full[a], False, len(full[a])))
        for j in diag[a]:
            calls.append((rows, [j], True, 1))
    return calls


def ulysses_kv_heads(heads: int, kv_heads: int, n: int) -> int:
    """Local kv heads entering the all-to-all after replication (``fived.parallel.context`` explains why)."""
    if kv_heads % n == 0:
        return kv_heads
    if n % kv_heads == 0:
        return n
    return heads


def traffic_per_layer(mode: str, b: int, s_local: int, heads: int, kv_heads: int, d: int, n: int,
                      nbytes: int = 4) -> dict[str, float]:
    """Bytes one cp rank sends per attention layer, {"forward", "backward"} (this module's rule).

    ``heads``/``kv_heads`` are the local (tp-cut) counts, ``s_local`` = S/cp.
    """
    if n == 1:
        return {"forward": 0.0, "backward": 0.0}
    kv = 2.0 * b * s_local * kv_heads * d * nbytes  # K and V of one block
    if mode == "ring":
        return {"forward": (n - 1) * kv, "backward": 2 * (n - 1) * kv}
    if mode == "ulysses":
        g2 = ulysses_kv_heads(heads, kv_heads, n)
        local = b * s_local * d * nbytes * (2 * heads + 2 * g2)  # q, k', v', out
        return {"forward": (n - 1) / n * local, "backward": (n - 1) / n * local}
    if mode == "allgather":
        vol = (n - 1) / n * n * kv  # all-gather of the full K/V; reduce-scatter of its grads
        return {"forward": vol, "backward": vol}
    raise ValueError(mode)


def activation_bytes(mode: str, b: int, s_local: int, heads: int, kv_heads: int, d: int, n: int,
                     nbytes: int = 4) -> int:
    """Bytes the attention core saves for backward on one cp rank (ring: q, K/V, out, lse)."""
    tok = b * s_local
    if mode == "ring":
        return tok * d * 4 * (heads + 2 * kv_heads) + tok * d * nbytes * heads + tok * heads * 4
    raise ValueError(mode)


def attention_flops(b: int, seq_len: int, heads: int, d: int, n: int, layout: str = "zigzag"
                    ) -> list[float]:
    """Forward attention FLOPs the ring kernel executes on each cp rank (causal pairs whole)."""
    c = seq_len // (2 * n)
    out = []
    for r in range(n):
        qc = chunk_ids(r, n, layout)
        pairs = sum(p for src in range(n) for *_, p in step_plan(qc, chunk_ids(src, n, layout), c))
        out.append(4.0 * b * heads * c * c * d * pairs)
    return out


# ---------------------------------------------------------------------------------- documents
def doc_pairs(lengths: list[int]) -> float:
    """Attention (q, k) pairs of a row of documents under document masks: Σ Lᵢ(Lᵢ+1)/2 — the
    work the ledger charges instead of S(S+1)/2."""
    return float(sum(n * (n + 1) // 2 for n in lengths))


def _doc_starts(lengths: list[int]) -> list[int]:
    """Each token's document start (the row's tokens in order)."""
    out, a = [], 0
    for n in lengths:
        out.extend([a] * n)
        a += n
    return out


def token_ranks(lengths: list[int], n: int, balancer: str = "zigzag", block: int = 0
                ) -> list[int]:
    """The cp rank of each token of a row under ``balancer``:

    * ``zigzag`` — 2n chunks, rank r holds chunks r and 2n−1−r (the runtime's layout);
    * ``ptrr`` — torch's processing-time round robin (``_PTRRLoadBalancer``): the row cut into
      blocks of ``block`` tokens, each block's work (its queries' visible keys) computed, the
      blocks sorted by work and dealt to the ranks in snake order (0..n−1, n−1..0, ...);
    * ``doc-headtail`` — torch's per-document head-tail: every document cut into 2n pieces,
      rank r taking pieces r and 2n−1−r of each (token counts per rank then differ by the
      documents' remainders)."""
    S = sum(lengths)
    if balancer == "zigzag":
        c = S // (2 * n)
        owner = {}
        for r in range(n):
            for g in chunk_ids(r, n):
                owner[g] = r
        return [owner[min(t // c, 2 * n - 1)] for t in range(S)]
    if balancer == "doc-headtail":
        out = []
        for L in lengths:
            cuts = [L * i // (2 * n) for i in range(2 * n + 1)]
            for i in range(2 * n):
                r = i if i < n else 2 * n - 1 - i
                out.extend([r] * (cuts[i + 1] - cuts[i]))
        return out
    if balancer == "ptrr":
        block = block or max(1, S // (8 * n))
        starts = _doc_starts(lengths)
        nb = S // block
        work = [sum(t - starts[t] + 1 for t in range(i * block, (i + 1) * block))
                for i in range(nb)]
        order = sorted(range(nb), key=lambda i: -work[i])
        out = [0] * S
        for k, i in enumerate(order):
            lap, pos = divmod(k, n)
            r = pos if lap % 2 == 0 else n - 1 - pos
            for t in range(i * block, (i + 1) * block):
                out[t] = r
        return out
    raise ValueError(f"unknown balancer {balancer!r}")


def rank_work(lengths: list[int], ranks: list[int], n: int) -> list[float]:
    """Per cp rank: the (q, k) pairs its queries compute under document masks (exact, the
    work of an ideal kernel that skips every masked pair)."""
    starts = _doc_starts(lengths)
    out = [0.0] * n
    for t, r in enumerate(ranks):
        out[r] += t - starts[t] + 1
    return out


def ring_chunk_pairs(lengths: list[int], n: int) -> list[int]:
    """Per cp rank: the chunk pairs (c × c blocks) the zigzag ring computes under document
    masks — a pair is skipped when the K/V chunk is later or shares no document with the query
    chunk (``fived.parallel.context.doc_plan``, token for token)."""
    S = sum(lengths)
    c = S // (2 * n)
    doc = []
    for i, L in enumerate(lengths):
        doc.extend([i] * L)
    out = []
    for r in range(n):
        pairs = 0
        for qc in chunk_ids(r, n):
            for kc in range(2 * n):
                if kc > qc:
                    continue
                q0, q1, k0, k1 = doc[qc * c], doc[qc * c + c - 1], doc[kc * c], doc[kc * c + c - 1]
                if q0 > k1 or q1 < k0:  # no shared document
                    continue
                pairs += 1  # a shared document: its keys in kc precede its queries in qc
        out.append(pairs)
    return out
