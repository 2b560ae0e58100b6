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
