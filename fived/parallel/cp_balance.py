"""``--cp-balance``: which blocks of each row a context-parallel rank holds.

``zigzag`` (the default): rank i of n holds chunks i and 2n−1−i of every row
(``fived.ledger.context.chunk_ids``). ``ptrr`` (ring attention with ``--doc-mask``): torch's
processing-time round robin per row — the row cut into 8·n blocks, each block's work
w_b = Σ over its queries of the keys their document lets them see, the blocks sorted by w_b
(descending, ties in order) and dealt to the ranks in snake order 0..n−1, n−1..0, ...
``balanced_positions`` is the global positions a rank holds under ``ptrr`` (the trainer's
sequence shard); ``rank_chunks`` every rank's chunk ids (the ring's block plan).
``fived.ledger.context.token_ranks(..., "ptrr")`` is the same rule, torch-free.
"""

from __future__ import annotations

import torch

from ..ledger.context import chunk_ids
from ..model.documents import reset_positions

BALANCERS = ("zigzag", "ptrr")
PTRR_CHUNKS = 8  # chunks per cp rank under ``ptrr`` (blocks of S/(8·cp) tokens)


def ptrr_chunks(docs: torch.Tensor, n: int) -> torch.Tensor:
    """torch's processing-time round robin (``_PTRRLoadBalancer``), per row: the row cut into
    8·n blocks, each block's work (Σ over its queries of the keys their document lets them
    see) computed, the blocks sorted by work (descending, ties in order) and dealt to the ranks
    in snake order 0..n−1, n−1..0, ...; (b, n, 8) chunk ids, each rank's ascending.
    ``fived.ledger.context.token_ranks(..., "ptrr")`` is the same rule, torch-free."""
    b, S = docs.shape
    nb = PTRR_CHUNKS * n
    work = (reset_positions(docs) + 1).view(b, nb, S // nb).sum(-1)
    order = torch.sort(work, dim=1, descending=True, stable=True).indices
    k = torch.arange(nb, device=docs.device)
    lap, pos = k // n, k % n
    owner = torch.where(lap % 2 == 0, pos, n - 1 - pos)  # rank of sorted slot k
    out = torch.empty(b, n, PTRR_CHUNKS, dtype=torch.long, device=docs.device)
    for r in range(n):
        out[:, r] = order[:, owner == r].sort(dim=1).values
    return out


def rank_chunks(docs: torch.Tensor, n: int, layout: str, balance: str) -> torch.Tensor:
    """(b, n, k) global chunk ids of every cp rank's local chunks, per row."""
    if balance == "ptrr":
        return ptrr_chunks(docs, n)
    ids = torch.tensor([chunk_ids(r, n, layout) for r in range(n)], device=docs.device)
    return ids.expand(docs.shape[0], n, 2)


def balanced_positions(docs: torch.Tensor, n: int, rank: int) -> torch.Tensor:
    """``ptrr``: the global positions (b, S/n) this cp rank holds, per row, in local order."""
    ch = ptrr_chunks(docs, n)[:, rank]  # (b, k)
    c = docs.shape[1] // (PTRR_CHUNKS * n)
    return (ch[:, :, None] * c + torch.arange(c, device=docs.device)).flatten(1)
