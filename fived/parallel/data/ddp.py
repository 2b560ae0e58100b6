"""DDP (ZeRO-0): every member of a reduction group holds all parameters, gradients, masters and
optimizer state; each bucket's gradient is all-reduced (summed) in place.

Ring all-reduce, bytes sent per rank per step (N = group size):

    2·(N−1)/N · gradient bytes

(``--collectives ring``: fived's own send/recv ring, ``fived.comm.ring``, sends exactly these
bytes when N divides each bucket's element count, always for N = 2; it runs synchronously in
the backward hook, so nothing overlaps it.)

Model states, bytes per parameter (Ψ parameters):

    fp32:                 params 4 + grads 4 (fp32)           + Adam m, v 8 = 16Ψ
    bf16/fp16, fp32 grad: params 2 + grads 4 (fp32) + master 4 + Adam m, v 8 = 18Ψ  (default)
    bf16/fp16, low grad:  params 2 + grads 2 (compute dtype) + master 4 + m, v 8 = 16Ψ
                          (``grad_reduce_dtype = "bf16"``: reduce in the compute dtype)
"""

from __future__ import annotations

from typing import Any

from ...comm import ops, ring
from .base import DataParallel
from .buckets import Bucket


class DDP(DataParallel):
    """Replicated states, all-reduced gradients (the base's persistent full gradient buffers)."""

    stage = 0

    def shard_count(self, group: Any) -> int:
        return 1

    def start_reduce(self, b: Bucket) -> Any:
        if self.par.collectives == "ring":  # fived.comm.ring, synchronous: no overlap
            ring.ring_all_reduce(b.grad, b.group)
            return ops.Handle(None, b.group, "all_reduce")
        return ops.all_reduce(b.grad, b.group, async_op=True)
