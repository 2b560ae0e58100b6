"""The three things a ZeRO stage chooses, as protocols, and the no-op parameter gather of
stages 0-2. ``base.DataParallel`` composes one of each with the stage-independent machinery
(``layout``, ``reduce``, ``master``, ``accounting``); docs/engine.md has the table.

    stage      Sharding (what a member holds,   GradStore (the gradient     ParamGather (whole
               its collectives)                  buffer's life)              parameters when)
    ZeRO-0     AllReduce          (ddp)         FullGrads   (grads)         NoGather (here)
    ZeRO-1     ReduceScatter      (zero12)      FullGrads                   NoGather
    ZeRO-2     ReduceScatter                    ShardGrads  (grads)         NoGather
    ZeRO-3     ShardedParams      (zero3)       ShardGrads                  UnitGather (zero3)

Shard arithmetic (``buckets``): a bucket of ``padded`` elements over ``shard_count(group)`` = N
members, member i owns ``[i·S, (i+1)·S)``, S = padded / N (N = 1: it owns everything).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .buckets import Bucket


class Sharding(Protocol):
    """How many shards a bucket has, how its gradient is reduced and its parameters published."""

    def shard_count(self, group: Any) -> int:
        """Equal shards of each bucket over its group (1: every member holds everything)."""

    def start_reduce(self, b: Bucket) -> Any:
        """Start bucket ``b``'s gradient reduction asynchronously; its handle (``.wait()``)."""

    def sum_over_shards(self, sums: dict[str, torch.Tensor]) -> None:
        """Add up the per-group Σg² of members that own disjoint shards (replicated: nothing)."""

    def gather_grad(self, b: Bucket) -> torch.Tensor:
        """Bucket ``b``'s whole reduced gradient (padded flat), for ``full_grads``."""

    def gather_params(self, buckets: list[Bucket]) -> None:
        """After the step: bring every member's updated shard into the full parameters."""

    def param_state(self, b: Bucket) -> torch.Tensor:
        """The parameter tensor of ``b`` this rank holds between steps (model-state bytes)."""

    def param_extra(self, b: Bucket) -> list[torch.Tensor]:
        """More parameter state of ``b`` held between steps: ZeRO-1/2's fp8 gather keeps the
        bucket's whole e4m3 casts (uint8) and their fp32 scales; else empty."""


class GradStore(Protocol):
    """Where a bucket's gradient lives: ``attach`` (``p.grad`` are views of the full buffer, so
    autograd accumulates in place; otherwise the hook copies each gradient in), ``in_flight``
    (at most this many transient buffers per group being reduced at once; 0: no limit)."""

    attach: bool
    in_flight: int

    def build(self, b: Bucket) -> None:
        """Allocate ``b.grad`` / ``b.grad_shard`` at build time."""

    def reset(self, b: Bucket) -> None:
        """Start of a step: zero what persists, point (or unpoint) ``p.grad``."""

    def ensure(self, b: Bucket) -> torch.Tensor:
        """Bucket ``b``'s full gradient buffer (allocated here when it is transient)."""

    def after_reduce(self, b: Bucket) -> None:
        """Bucket ``b``'s reduction is complete (a transient buffer keeps its shard, is freed)."""

    def state(self, b: Bucket) -> torch.Tensor:
        """The gradient tensor of ``b`` this rank holds between steps (model-state bytes)."""


class ParamGather(Protocol):
    """When the parameters are whole. Stages 0-2 keep them whole (``NoGather``); ZeRO-3 gathers
    each unit before its forward and backward and frees it after (``zero3.UnitGather``). The
    pipeline executor and the trainer call the first three through the engine; the reduction
    calls ``after_grad`` / ``after_finish``; ``zero_grad`` calls ``reset``."""

    def begin_compute(self, chunk: int, kind: str) -> None:
        """The pipeline executor is about to run action ``kind`` (F, B, W) on chunk ``chunk``."""

    def end_compute(self, chunk: int, kind: str, next_chunk: int | None = None) -> None:
        """The executor has run action ``kind`` on ``chunk``; its next F or B is on
        ``next_chunk``."""

    def end_forward(self) -> None:
        """A forward-only pass (evaluation, ``torch.no_grad``) is over: free what it gathered."""

    def after_grad(self, b: Bucket, j: int) -> None:
        """Parameter ``j`` of bucket ``b`` has its gradient (any micro-batch)."""

    def after_finish(self) -> None:
        """Every reduction of the step is complete."""

    def reset(self) -> None:
        """Start of a step."""


class NoGather:
    """The ``ParamGather`` of ZeRO-0/1/2: the parameters are always whole, nothing to do."""

    def __init__(self, *args: Any) -> None:
        pass

    def begin_compute(self, chunk: int, kind: str) -> None:
        pass

    def end_compute(self, chunk: int, kind: str, next_chunk: int | None = None) -> None:
        pass

    def end_forward(self) -> None:
        pass

    def after_grad(self, b: Bucket, j: int) -> None:
        pass

    def after_finish(self) -> None:
        pass

    def reset(self) -> None:
        pass
