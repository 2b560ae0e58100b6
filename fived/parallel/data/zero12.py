"""ZeRO-1 and ZeRO-2 (Rajbhandari et al. 2020) over the data-parallel group (dense: dp·ep·cp;
experts: dp·cp). The difference between them: whether the full gradient buffer persists.

Each bucket's flat buffer is padded to a multiple of N so every member owns an equal shard
``[i·S, (i+1)·S)`` (``buckets``); the padding is reported (``memory()["padding"]``).

* ZeRO-1 (``Zero1``): fp32 master shard + Adam m, v shard; the full gradient buffer stays.
  Gradients are reduce-scattered (in place: the member's reduced shard lands in its own slice)
  on the last micro-batch's backward, each member steps its shard, then the parameters are
  all-gathered (in place).
* ZeRO-2 (``Zero2``): as ZeRO-1, but a bucket's full gradient buffer exists only from its first
  gradient until its reduce-scatter completes (reported as ``buffers``, the step's peak; at most
  two per group in flight); the rank keeps only its gradient shard. With gradient accumulation
  the transient buffer lives across the micro-batches of a step.

Model-state bytes per rank (Ψ parameters; P params, G grads — 4 with an fp32 gradient buffer,
2 in bf16 —, M the fp32 master; fp32 training: params 4, no separate master, Adam 8):

    ZeRO-1: P + G + (M + 8)/N·Ψ   bf16: 2Ψ + 2Ψ + 12Ψ/N     fp32: 4Ψ + 4Ψ + 8Ψ/N
    ZeRO-2: P + (G + M + 8)/N·Ψ   bf16: 2Ψ + (2Ψ + 12Ψ)/N   fp32: 4Ψ + 12Ψ/N
    fp8 gather, the fp8 linears' Ψ_f8 of Ψ: P·Ψ_f8 becomes 1·Ψ_f8 + 4·A + P·Ψ_f8/N

Traffic per step, bytes sent per rank:

    reduce-scatter (N−1)/N · grad bytes + all-gather (N−1)/N · param bytes
    fp8 gather: all-gather (N−1)/N · 1 byte on the fp8 buckets + all_reduce(4·A) per fp8 bucket

The fp8 gather (``--zero 1|2 --fp8 tensorwise|blockwise``, ``fived.ledger.params.fp8_gather``;
``--no-fp8-gather`` off; Megatron-Core's ``--fp8-param-gather`` with its distributed
optimizer): the fp8 linears' weights are buckets of their own (``layout.fp8_split``, inside
each ``bucket_mb`` piece). For those buckets (N > 1) the rank keeps its compute-dtype shard (a
copy; the optimizer writes it, checkpoints read it) and the whole bucket's e4m3 cast with its
scales (A tile amaxes, ``fp8.amax_count``), between steps; the compute-dtype whole buffer is
freed after the build (its storage resized to 0: the parameters are views of it, so nothing
can read a stale piece). After the build, every optimizer step and ``publish_params`` (a
checkpoint load) the scales are taken again (the amaxes max-reduced over the shard group, and
over tp where a tile spans the cut) and the shards' casts all-gathered (``fp8.Fp8Gather``);
the fp8 linears use the provided casts (``fived.model.fp8.provide``), bit for bit one rank's
cast of the whole weight. Rowwise is not gathered in fp8: its two casts of W (per row for the
forward, per column for the dgrad) kept whole would be bf16's 2 bytes per element.

``--collectives ring`` runs both through ``fived.comm.ring`` (synchronously; the padded buckets
make its bytes exactly these). ZeRO-3 inherits the ring reduce-scatter; its parameter gathers
stay the backend's.

Pieces (docs/engine.md): both use ``ReduceScatter`` (the ``Sharding``: reduce-scatter, the
all-gather after the step — the fp8 buckets' through ``fp8.Fp8Gather`` —, the norm summed over
the shards); ZeRO-1 keeps ``FullGrads``, ZeRO-2 uses ``ShardGrads`` (``grads``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ...comm import ops, ring
from .base import DataParallel
from .buckets import Bucket
from .fp8 import Fp8Gather
from .grads import FullGrads, ShardGrads


class Replicated:
    """Hybrid sharding's second half: bucket ``b``'s reduce-scatter over its shard group, then
    the all-reduce of the shard's piece across the replicas (``dp_replicate``). ``advance``
    starts the all-reduce once the reduce-scatter is done; every replica starts them in launch
    order (``ReduceScatter.pending``), so the replicate group's collectives match."""

    def __init__(self, rs: Any, b: Bucket, replicate: Any, owner: ReduceScatter):
        self.rs, self.b, self.replicate, self.owner = rs, b, replicate, owner
        self.ar: Any = None

    def rs_done(self) -> bool:
        work = getattr(self.rs, "work", None)
        return work is None or work.is_completed()

    def advance(self) -> None:
        if self.ar is None:
            self.rs.wait()
            self.ar = ops.all_reduce(self.b.grad[self.b.lo:self.b.hi], self.replicate,
                                     async_op=True)

    def wait(self) -> Any:
        self.owner.advance_all()  # the earlier buckets' all-reduces first, in launch order
        self.ar.wait()


class ReduceScatter:
    """ZeRO-1/2's ``Sharding``: N shards per bucket; the gradient reduce-scattered in place (the
    member's reduced shard lands in its own slice), the updated parameters all-gathered in place
    after the step; the global norm sums the members' Σg² (under ``metrics``).

    Hybrid sharding (``--dp-replicate`` M > 1): N is the shard group's size (``b.group``:
    dense_shard, expert_shard); after a bucket's reduce-scatter the owned piece is all-reduced
    across the M replicas (``dp_replicate``), so it holds the sum over all of dp. The all-reduce
    of bucket k starts when bucket k+1's reduce-scatter is launched and k's is complete (or at
    the wait), so it overlaps the reduce-scatters after it."""

    def __init__(self, grid: Any, par: Any, device: torch.device):
        self.grid, self.collectives, self.device = grid, par.collectives, device
        self.replicate = grid["dp_replicate"] if getattr(grid, "hybrid", False) else None
        self.pending: list[Replicated] = []  # launched, all-reduce not yet started
        self.fp8: Any = None  # ZeRO-1/2's fp8 gather (``fp8.Fp8Gather``; ``Zero1`` sets it)

    def shard_count(self, group: Any) -> int:
        return group.size

    def start_reduce(self, b: Bucket) -> Any:
        if self.collectives == "ring":  # fived.comm.ring, synchronous (padded: exact bytes)
            b.grad[b.lo:b.hi].copy_(ring.ring_reduce_scatter(b.grad, b.group))
            if self.replicate is not None:
                ring.ring_all_reduce(b.grad[b.lo:b.hi], self.replicate)  # in place
            return ops.Handle(None, b.group, "reduce_scatter")
        h = ops.reduce_scatter(b.grad, b.group, async_op=True, out=b.grad[b.lo:b.hi])
        if self.replicate is None:
            return h
        while self.pending and self.pending[0].rs_done():  # never blocks: overlap
            self.pending.pop(0).advance()
        chained = Replicated(h, b, self.replicate, self)
        self.pending.append(chained)
        return chained

    def advance_all(self) -> None:
        while self.pending:
            self.pending.pop(0).advance()

    def sum_over_shards(self, sums: dict[str, torch.Tensor]) -> None:
        for name, s in sums.items():
            group = self.grid[self.grid.shard_group(name)] if hasattr(
                self.grid, "shard_group") else self.grid[name]
            ops.all_reduce(s, replace(group, name="metrics"))

    def gather_grad(self, b: Bucket) -> torch.Tensor:
        flat = torch.empty(b.padded, dtype=b.grad_shard.dtype, device=self.device)
        ops.all_gather_into(flat, b.grad_shard, replace(b.group, name="metrics"))
        return flat

    def gather_params(self, buckets: list[Bucket]) -> None:
        """Every member's updated shard into the whole parameters: in place, in the compute
        dtype; the fp8 gather's buckets (``fp8``) as e4m3 casts with scales taken again."""
        fp8 = self.fp8
        if fp8 is not None:
            fp8.stale()
        handles = []
        for b in buckets:
            if fp8 is not None and fp8.owns(b):
                handles += fp8.start(b)
            elif self.collectives == "ring":
                b.param_full.copy_(ring.ring_all_gather(b.param_shard, b.group))
            else:
                handles.append(ops.all_gather_into(b.param_full, b.param_shard, b.group,
                                                   async_op=True))
        for h in handles:
            h.wait()

    def param_state(self, b: Bucket) -> torch.Tensor:
        """The whole compute-dtype buffer; the fp8 gather's buckets: the owned shard (their
        whole weights are the casts, ``param_extra``)."""
        return b.param_shard if self.fp8 is not None and self.fp8.owns(b) else b.param_full

    def param_extra(self, b: Bucket) -> list[torch.Tensor]:
        """The parameter state beside ``param_state``: the fp8 gather's e4m3 casts of the whole
        bucket and their scales (``fp8.Fp8Gather.held``; ZeRO-1/2 keep them between steps)."""
        return self.fp8.held(b) if self.fp8 is not None and self.fp8.owns(b) else []


class Zero1(DataParallel):
    """Sharded masters and optimizer state; persistent full gradients. With the fp8 gather
    (``fived.ledger.params.fp8_gather``) the fp8 linears' buckets are held as the owned shard
    and the whole e4m3 cast (``fp8.Fp8Gather``), gathered here once after the build."""

    stage = 1
    sharding_type = ReduceScatter
    grads_type = FullGrads

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        if self.stage < 3:  # ZeRO-3 gathers per unit (``zero3.UnitGather``)
            fp8 = Fp8Gather.of(self.buckets, self.placements, self.grid, self.par)
            if fp8 is not None and fp8.owned:
                self.sharding.fp8 = fp8
                self.sharding.gather_params(fp8.owned)

    def close(self) -> None:
        super().close()
        if self.sharding.fp8 is not None:
            self.sharding.fp8.withdraw()


class Zero2(Zero1):
    """ZeRO-1 with transient full gradient buffers: only the owned gradient shard persists."""

    stage = 2
    grads_type = ShardGrads
