"""ZeRO-1/2/3 (Rajbhandari et al. 2020) over the data-parallel group (dense: dp·ep·cp; experts:
dp·cp), on the flat buckets of ``fived.parallel.data``.

Each bucket's flat buffer is padded to a multiple of N so every member owns an equal shard
``[i·S, (i+1)·S)``; the padding is reported (``memory()["padding"]``).

* ZeRO-1: fp32 master shard + Adam m, v shard; the full gradient buffer stays. Gradients are
  reduce-scattered (in place) on the last micro-batch's backward, each member steps its shard,
  then the parameters are all-gathered (in place).
* ZeRO-2: as ZeRO-1 but the full gradient buffer of a bucket exists only from its first
  gradient until its reduce-scatter completes (reported as ``buffers``, the step's peak);
  the rank keeps only its gradient shard.
* ZeRO-3: the parameters are sharded too. Each unit (a transformer ``Block``, plus one root unit
  for the embedding, final norm and head) is all-gathered just before its forward, freed after
  it, gathered again before its backward (a hook on the unit's output gradient) and freed when
  all its gradients are in; the next unit's all-gather is prefetched (async) so it overlaps
  compute. Freeing resizes the flat storage to 0; the parameters stay views of it.

Model-state bytes per rank (Ψ parameters; "grad" = 4 with an fp32 gradient buffer, 2 in bf16;
fp32 training: params 4, no separate master, Adam 8):

    ZeRO-1: P + G + (M + 8)/N·Ψ   bf16: 2Ψ + 2Ψ + 12Ψ/N     fp32: 4Ψ + 4Ψ + 8Ψ/N
    ZeRO-2: P + (G + M + 8)/N·Ψ   bf16: 2Ψ + (2Ψ + 12Ψ)/N   fp32: 4Ψ + 12Ψ/N
    ZeRO-3: (P + G + M + 8)/N·Ψ   bf16: 16Ψ/N (18Ψ/N, fp32 grads)   fp32: 16Ψ/N

Traffic per step (one micro-batch), bytes sent per rank:

    ZeRO-1/2: reduce-scatter (N−1)/N·grad bytes + all-gather (N−1)/N·param bytes
    ZeRO-3:   all-gather forward + all-gather backward + reduce-scatter = 3(N−1)/N·param bytes
              (same dtype for params and grads)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..comm import ops
from ..config import ConfigError
from .data import Bucket, DataParallel, in_backward, nbytes


class ZeroEngine(DataParallel):
    """ZeRO-1 and ZeRO-2 (``par.zero``)."""

    def __init__(self, model: nn.Module, grid: Any, par: Any, train: Any):
        if par.zero not in (1, 2):
            raise ConfigError([f"ZeroEngine runs ZeRO-1/2, not --zero {par.zero}"])
        super().__init__(model, grid, par, train)


class Unit:
    """A set of buckets (one per reduction group) gathered and freed together."""

    def __init__(self, name: str, buckets: list[Bucket]):
        self.name, self.buckets = name, buckets
        self.state = "free"  # free | inflight | full
        self.handles: list[Any] = []
        self.nparams = sum(len(b.params) for b in buckets)
        self.done = 0


class Zero3(DataParallel):
    """ZeRO-3: sharded parameters, gradients and optimizer state; per-unit gather with prefetch."""

    def __init__(self, model: nn.Module, grid: Any, par: Any, train: Any):
        if par.pp > 1:
            raise ConfigError([
                f"--zero 3 with --pp {par.pp}: ZeRO-3 gathers and frees each block around its "
                "forward and backward, and a pipeline schedule interleaves many micro-batches' "
                "forwards and backwards on a stage, so every block would stay gathered (or be "
                "gathered once per micro-batch twice over); use --zero 1 or --zero 2 with "
                "pipeline parallelism"])
        from ..model.llama import Block

        self.blocks = [m for m in model.modules() if isinstance(m, Block)]
        in_block = {id(p) for blk in self.blocks for p in blk.parameters()}
        self.root_params = [p for p in model.parameters() if p.requires_grad
                            and id(p) not in in_block]
        super().__init__(model, grid, par, train, zero=3)
        # units: blocks in forward order, then the root; buckets were built in backward order
        nb = len(self.blocks)
        per_unit: list[list[Bucket]] = [[] for _ in range(nb + 1)]
        for b in self.buckets:
            per_unit[b.unit_index].append(b)
        self.units = [Unit(f"block{i}", per_unit[i]) for i in range(nb)]
        self.root = Unit("root", per_unit[nb])
        self.unit_of: dict[int, Unit] = {}
        for u in self.units + [self.root]:
            for b in u.buckets:
                self.unit_of[b.index] = u
            u.state = "full"  # built gathered (the flat copies of the model's parameters)
            self.free(u)
        for i, blk in enumerate(self.blocks):
            blk.register_forward_pre_hook(self._pre_forward(i))
            blk.register_forward_hook(self._post_forward(i))
        model.register_forward_pre_hook(self._root_pre_forward)
        model.register_forward_hook(self._root_post_forward)

    # ------------------------------------------------------------------ layout
    def bucket_params(self) -> list[list[nn.Parameter]]:
        # backward order: the last block first, ..., the first block, then the root (whose
        # embedding gradient is the last to arrive)
        units = [[p for p in blk.parameters() if p.requires_grad] for blk in self.blocks]
        self._unit_ids = list(range(len(units) - 1, -1, -1)) + [len(units)]
        return [list(reversed(units[i])) for i in reversed(range(len(units)))] + [
            list(reversed(self.root_params))]

    def split_by_size(self) -> bool:
        return False

    def build_buckets(self, units: list[list[nn.Parameter]]) -> None:
        for ui, unit in zip(self._unit_ids, units):
            start = len(self.buckets)
            super().build_buckets([unit])
            for b in self.buckets[start:]:
                b.unit_index = ui

    def own_shard(self, flat: torch.Tensor, b: Any) -> torch.Tensor:
        """A copy: the full flat buffer is freed after each use, the shard must outlive it."""
        return flat[b.lo:b.hi].clone()

    def build_state(self) -> None:
        super().build_state()  # ZeRO-3 keeps no full gradients: only grad shards
        self.live_buffers = sum(nbytes(b.param_full) for b in self.buckets)

    # ------------------------------------------------------------------ gather / free
    def prefetch(self, u: Unit, ahead: bool = False) -> None:
        """Start unit u's all-gather asynchronously; ``ahead`` (a prefetch) is off with --no-overlap."""
        if u.state != "free" or (ahead and not self.overlap):
            return
        for b in u.buckets:
            b.param_full.untyped_storage().resize_(b.padded * b.param_full.element_size())
            self.hold(nbytes(b.param_full))
            u.handles.append(ops.all_gather_into(b.param_full, b.param_shard, b.group,
                                                 async_op=True))
        u.state = "inflight"

    def gather(self, u: Unit) -> None:
        self.prefetch(u)
        if u.state == "inflight":
            for h in u.handles:
                h.wait()
            u.handles = []
            u.state = "full"

    def free(self, u: Unit) -> None:
        if u.state == "free":
            return
        if u.state == "inflight":
            for h in u.handles:
                h.wait()
            u.handles = []
        for b in u.buckets:
            self.release(nbytes(b.param_full))
            b.param_full.untyped_storage().resize_(0)
        u.state = "free"

    # ------------------------------------------------------------------ hooks
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if in_backward():
            return
        self.gather(self.root)
        if self.units:
            self.prefetch(self.units[0], ahead=True)

    def _root_post_forward(self, module: nn.Module, args: Any, out: Any) -> None:
        if in_backward():
            return
        self.free(self.root)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._pre_backward(len(self.units)))

    def _pre_forward(self, i: int):
        def hook(module: nn.Module, args: Any) -> None:
            self.gather(self.units[i])
            if not in_backward() and i + 1 < len(self.units):
                self.prefetch(self.units[i + 1], ahead=True)
        return hook

    def _post_forward(self, i: int):
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if in_backward():  # a recompute forward: its backward comes next, keep the unit
                return
            self.free(self.units[i])
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(self._pre_backward(i))
        return hook

    def _pre_backward(self, i: int):
        """Before unit i's backward (i == len(units): the root, at the start of backward)."""
        def hook(grad: torch.Tensor) -> None:
            if i == len(self.units):
                self.gather(self.root)
                if self.units:
                    self.prefetch(self.units[-1], ahead=True)
            else:
                self.gather(self.units[i])
                if i > 0:
                    self.prefetch(self.units[i - 1], ahead=True)
        return hook

    def after_grad(self, b: Bucket, j: int) -> None:
        u = self.unit_of[b.index]
        u.done += 1
        if u.done == u.nparams:  # the unit's backward is complete on this micro-batch
            u.done = 0
            self.free(u)

    def after_finish(self) -> None:
        for u in self.units + [self.root]:
            u.done = 0
            self.free(u)

    def zero_grad(self) -> None:
        super().zero_grad()
        for u in getattr(self, "units", []) + ([self.root] if hasattr(self, "root") else []):
            u.done = 0

    # ------------------------------------------------------------------ step
    def publish_params(self) -> None:
        if self.separate_master:
            for b in self.buckets:
                b.param_shard.copy_(b.master)
        # no gather: each unit is gathered from its shard before its next forward
