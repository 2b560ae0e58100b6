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

import torch

from ...comm import ops, ring
from .base import DataParallel
from .buckets import Bucket
from .grads import FullGrads


class AllReduce:
    """ZeRO-0's ``Sharding``: one shard (every member holds everything), the gradient
    all-reduced in place; nothing to publish after the step."""

    def __init__(self, grid: Any, par: Any, device: torch.device):
        self.collectives = par.collectives

    def shard_count(self, group: Any) -> int:
        return 1

    def start_reduce(self, b: Bucket) -> Any:
        if self.collectives == "ring":  # fived.comm.ring, synchronous: no overlap
            ring.ring_all_reduce(b.grad, b.group)
            return ops.Handle(None, b.group, "all_reduce")
        return ops.all_reduce(b.grad, b.group, async_op=True)

    def sum_over_shards(self, sums: dict[str, torch.Tensor]) -> None:
        """Replicated: every member's Σg² is already the group's."""

    def gather_grad(self, b: Bucket) -> torch.Tensor:
        return b.grad_shard

    def gather_params(self, buckets: list[Bucket]) -> None:
        """The step updated every parameter in place on every member."""

    def param_state(self, b: Bucket) -> torch.Tensor:
        return b.param_full

    def param_extra(self, b: Bucket) -> list[torch.Tensor]:
        return []


class DDP(DataParallel):
    """Replicated states, all-reduced gradients, persistent full gradient buffers."""

    stage = 0
    sharding_type = AllReduce
    grads_type = FullGrads
