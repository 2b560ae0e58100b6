"""Bytes a rank sends in one collective — the one formula the runtime and the ledger share.

fived counts, for every collective, the bytes *this rank puts on the wire* under the ring (or
pairwise) algorithm, which is also nccl-tests' "bus bytes" per rank. With ``S`` the size in bytes
of the full buffer the collective is named by and ``n`` ranks in the group:

=============== ======================= ===========================================
op              S is                    bytes sent by one rank
=============== ======================= ===========================================
all_reduce      the buffer              2·(n−1)/n · S   (reduce-scatter + all-gather)
all_gather      the gathered output     (n−1)/n · S
reduce_scatter  the full input          (n−1)/n · S
all_to_all      the local input         (n−1)/n · S    (sent to the other n−1 ranks)
broadcast       the buffer              S on the root, 0 elsewhere (charged to the root)
reduce          the buffer              S on each non-root, 0 on the root
scatter, gather the full buffer         (n−1)/n · S    (root side; others S/n)
send            the message             S
recv            the message             0              (received, not sent)
=============== ======================= ===========================================

``busbw_factor`` is the nccl-tests factor that turns algorithm bandwidth into bus bandwidth.
No torch import here: the ledger uses this module for clusters that are not present.
"""

from __future__ import annotations

OPS = (
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce",
    "scatter", "gather", "send", "recv",
)


def busbw_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all", "scatter", "gather"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "send", "recv"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def bytes_sent(op: str, size_bytes: int, n: int) -> float:
    """Bytes one rank sends for collective ``op`` over ``n`` ranks on a buffer of ``size_bytes``."""
    if n <= 1 or op == "recv":
        return 0.0
    if op in ("send", "broadcast", "reduce"):  # broadcast: the root's bytes; reduce: a non-root's
        return float(size_bytes)
    return busbw_factor(op, n) * size_bytes
