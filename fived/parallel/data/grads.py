"""Gradient storage (the ``GradStore`` protocol): where a bucket's gradient lives and for how long.

* ``FullGrads`` (ZeRO-0, ZeRO-1): one persistent full buffer per bucket, ``padded`` elements of
  the gradient dtype G; when G is the compute dtype the parameters' ``.grad`` are views of it
  (autograd accumulates in place), otherwise the hook adds each gradient in and drops it.
  Bytes held: G·padded per bucket.
* ``ShardGrads`` (ZeRO-2, ZeRO-3): only the owned shard persists (G·padded/N); the full buffer
  is allocated at the bucket's first gradient (``ensure``), counted in ``buffers``, and freed
  when its reduce-scatter completes (``after_reduce``), at most ``in_flight`` = 2 per group
  being reduced at once. With micro-batches it lives across them (reductions start on the last).
"""

from __future__ import annotations

from typing import Any

import torch

from .accounting import Buffers
from .buckets import Bucket, nbytes


class FullGrads:
    """A persistent full gradient buffer per bucket (DDP, ZeRO-1)."""

    in_flight = 0

    def __init__(self, policy: Any, device: torch.device, buffers: Buffers):
        self.grad_dtype, self.device = policy.grad, device
        self.attach = policy.grad == policy.compute

    def build(self, b: Bucket) -> None:
        b.grad = torch.zeros(b.padded, dtype=self.grad_dtype, device=self.device)
        b.grad_shard = b.grad[b.lo:b.hi]

    def reset(self, b: Bucket) -> None:
        b.grad.zero_()
        for j, p in enumerate(b.params):
            p.grad = b.view(b.grad, j) if self.attach else None

    def ensure(self, b: Bucket) -> torch.Tensor:
        return b.grad

    def after_reduce(self, b: Bucket) -> None:
        """The buffer persists; its owned slice already holds the reduced shard."""

    def state(self, b: Bucket) -> torch.Tensor:
        return b.grad


class ShardGrads:
    """Transient full buffers, a persistent owned shard (ZeRO-2, ZeRO-3)."""

    attach = False
    in_flight = 2

    def __init__(self, policy: Any, device: torch.device, buffers: Buffers):
        self.grad_dtype, self.device, self.buffers = policy.grad, device, buffers

    def build(self, b: Bucket) -> None:
        b.grad = None
        b.grad_shard = torch.zeros(b.shard_numel, dtype=self.grad_dtype, device=self.device)

    def reset(self, b: Bucket) -> None:
        for p in b.params:
            p.grad = None

    def ensure(self, b: Bucket) -> torch.Tensor:
        if b.grad is None:
            b.grad = torch.zeros(b.padded, dtype=self.grad_dtype, device=self.device)
            self.buffers.hold(nbytes(b.grad))
        return b.grad

    def after_reduce(self, b: Bucket) -> None:
        """Keep the owned shard of the reduced gradient, drop the full buffer."""
        if b.grad is not None:
            b.grad_shard.copy_(b.grad[b.lo:b.hi])
            self.buffers.release(nbytes(b.grad))
            b.grad = None

    def state(self, b: Bucket) -> torch.Tensor:
        return b.grad_shard
