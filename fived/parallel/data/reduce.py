"""The gradient reduction: hooks, launch order, overlap, ``finish``.

Every rank computes the gradient of Σ_local-tokens CE / global_tokens, so the *sum* over the
data-parallel group is exactly the one-rank gradient (no averaging, any number of micro-batches).

A post-accumulate-grad hook on every parameter moves its gradient into the bucket (the
``GradStore``), tells the ``ParamGather`` (ZeRO-3 frees a unit whose gradients are all in) and,
on the last micro-batch's backward only, sums a gradient that is partial over model-parallel
groups (``Placement.grad_sum``, e.g. norm weights under sequence parallelism) and counts it; a
bucket whose gradients are all there starts its reduction asynchronously (the ``Sharding``'s
all-reduce or reduce-scatter, through the engine's ``start_reduce``). Buckets start strictly in
order per group, so every rank issues the same collectives in the same sequence, and
communication overlaps the rest of backward. With transient buffers (``GradStore.in_flight`` =
k) launching bucket n waits for bucket n − k − 1 of the group first. ``finish()`` starts
whatever is left (a bucket with an unused parameter, or everything with ``--no-overlap``) and
waits for all of them. Bytes sent per rank per step: the ``Sharding``'s (ddp.py, zero12.py).

A gradient summed over the embedding group (``embed``: the first and last pipeline stage's
copies of the embedding, a bucket of their own laid out alike on both: ``layout.alone``) is
summed in ``finish``, once its bucket is reduced over data parallelism: the owned shard (the
whole buffer without ZeRO) is all-reduced over ``embed``, after the backward as Megatron does —
never in the hook, where a blocking all-reduce inside the last stage's backward would hold back
the gradient the first stage waits for — and last, so both copies get the same bits.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ...comm import ops
from .buckets import Bucket

DEFERRED = "embed"  # summed in ``finish``, over the reduced shard (the embedding group)


class Reduction:
    """The reduction machinery of one engine. ``stage`` is the engine: its ``ensure_grad`` and
    ``start_reduce`` are the stage's seams (tests and figures wrap them there)."""

    def __init__(self, stage: Any, buckets: list[Bucket], grads: Any, gathers: Any, grid: Any,
                 par: Any):
        self.stage, self.buckets, self.grads, self.gathers = stage, buckets, grads, gathers
        self.grid = grid
        self.overlap = bool(par.overlap)
        self.last_micro = True
        self.order: dict[str, list[Bucket]] = {}  # launch order per group
        for b in buckets:
            self.order.setdefault(b.group_name, []).append(b)
        self.next: dict[str, int] = {}
        self.where: dict[int, tuple[Bucket, int]] = {}
        self.hooks = []  # the parameters' hooks hold the engine (a cycle through C++): close()
        for b in buckets:
            for j, p in enumerate(b.params):
                self.where[id(p)] = (b, j)
                self.hooks.append(p.register_post_accumulate_grad_hook(self.grad_ready))

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def reset(self) -> None:
        """Start of a step: nothing counted, launched or pending; gradients reset."""
        for b in self.buckets:
            b.ready, b.launched, b.handle = 0, False, None
            self.grads.reset(b)
        self.next = {name: 0 for name in self.order}

    def set_last_micro(self, last: bool) -> None:
        """Called before each micro-batch's backward; reductions start only on the last one."""
        self.last_micro = last

    def grad_ready(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook: move the gradient into its bucket; on the last
        micro-batch, count it and start every bucket that is complete, in order."""
        b, j = self.where[id(p)]
        if not self.grads.attach:
            g = p.grad
            if g is not None:
                b.view(self.stage.ensure_grad(b), j).add_(g.detach())
                p.grad = None
        self.gathers.after_grad(b, j)
        if not self.last_micro or not self.overlap:
            return
        for name in b.grad_sum[j]:
            if name == DEFERRED:
                continue
            ops.all_reduce(b.view(self.stage.ensure_grad(b), j), self.grid[name])
        b.ready += 1
        if b.ready == len(b.params):
            self.launch_ready(b.group_name)

    def launch_ready(self, name: str) -> None:
        seq, k = self.order[name], self.grads.in_flight
        while self.next[name] < len(seq) and seq[self.next[name]].ready == len(
                seq[self.next[name]].params):
            self.launch(seq[self.next[name]])
            self.next[name] += 1
            if k and self.next[name] > k:  # at most k transient buffers of the group in flight
                older = seq[self.next[name] - k - 1]
                if older.handle is not None:
                    self.wait(older)

    def launch(self, b: Bucket) -> None:
        self.stage.ensure_grad(b)
        b.handle = self.stage.start_reduce(b)
        b.launched = True

    def wait(self, b: Bucket) -> None:
        if b.handle is not None:
            b.handle.wait()
            b.handle = None
        self.grads.after_reduce(b)

    def reduce_replicated(self) -> None:
        """Sum gradients that are partial over model-parallel groups (``grad_sum``), e.g. norm
        weights under sequence parallelism (with overlap the hook does it)."""
        for b in self.buckets:
            for j, names in enumerate(b.grad_sum):
                for name in (n for n in names if n != DEFERRED):
                    ops.all_reduce(b.view(self.stage.ensure_grad(b), j), self.grid[name])

    def finish(self) -> None:
        """Start every reduction not yet started (all of them with ``--no-overlap``), in bucket
        order, and wait for all of them."""
        if not self.overlap:
            self.reduce_replicated()
        for name, seq in self.order.items():
            for b in seq[self.next[name]:]:
                self.launch(b)
            self.next[name] = len(seq)
        for b in self.buckets:
            self.wait(b)
        for b in self.buckets:  # the embedding group: the reduced shards, summed
            if any(DEFERRED in names for names in b.grad_sum):
                ops.all_reduce(b.grad_shard, self.grid[DEFERRED])
        self.gathers.after_finish()
