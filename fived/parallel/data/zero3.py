"""ZeRO-3 (Rajbhandari et al. 2020): ZeRO-2 with the parameters sharded too.

The gather units are given by the caller (``units``: the transformer blocks, in forward order);
the parameters in no unit form one root unit (embedding, final norm, head). Each unit has one
bucket per reduction group, laid out last unit first, root last (≈ backward order). A unit is
all-gathered just before its forward, freed after it, gathered again before its backward (a
hook on the unit's output gradient) and freed when all its gradients are in — except the root,
which stays gathered from its forward to its backward (the loss's backward starts with the
head; FSDP2 keeps its root so too) — ; the next unit's
all-gather is prefetched (async) so it overlaps compute (``--no-overlap``: gathers on demand).
Freeing resizes the flat storage to 0; the parameters stay views of it. A recompute forward
(inside backward) keeps its unit gathered for the backward that follows.

With pipeline parallelism (pp > 1) the gather units are the rank's pipeline chunks (one per
virtual stage: the stage's blocks with its embedding or norm and head), one bucket per (chunk,
group), and the executor drives them around every F and B action (``begin_compute`` /
``end_compute``; a split backward's W reads no weight, so it needs none):

    --zero3-pp-gather step    all-gather each chunk once per step (the first action starts all
                              of them, asynchronously) and keep it to the step's end; the
                              stage's parameters stay whole through the schedule (ZeRO-2's
                              parameter memory during the step, but one all-gather per step)
    --zero3-pp-gather micro   all-gather the chunk before each F and each B and free it after
                              ("reshard after forward"; the next action's chunk is prefetched
                              as soon as this one is freed): only one chunk is whole at a
                              time, at the price of 2m all-gathers per chunk per step

Evaluation (``torch.no_grad``) gathers each unit before its forward and frees it after, as
training does; its outputs need no gradient, so no backward hook is registered, no gradient
buffer is touched and nothing is reduced (``end_forward`` frees what a pass kept).

Model-state bytes per rank (Ψ parameters; P params, G grads, M fp32 master, 8 Adam):

    (P + G + M + 8)/N·Ψ     bf16: 16Ψ/N (18Ψ/N, fp32 grads)     fp32: 16Ψ/N

plus the gathered units as ``buffers`` (the step's peak). Traffic per step (one micro-batch),
bytes sent per rank:

    all-gather forward + all-gather backward + reduce-scatter = (3Ψ − Ψ_root)(N−1)/N · P
    (Ψ_root: the root's parameters, gathered once per micro-batch; ≈ 3(N−1)/N · param bytes
    for a deep model; same dtype for params and grads; with m micro-batches the gathers run m
    times each)
    pp, per step:  (1 + 1)·(N−1)/N · param bytes       (all-gather once, reduce-scatter once)
    pp, per micro: (2m + 1)·(N−1)/N · param bytes

Pieces (docs/engine.md): ``ShardedParams`` (the ``Sharding``: ZeRO-1/2's reduce-scatter, no
all-gather after the step, the shard is the parameter state), ``UnitLayout`` (one bucket per
(unit, group), built gathered and freed at once), ``ShardGrads`` (ZeRO-2's), and ``UnitGather``,
the ``ParamGather`` that does all of the above around forward and backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...comm import ops
from .accounting import Buffers
from .base import Alias
from .buckets import Bucket, Named, nbytes
from .fp8 import Fp8Gather
from .layout import Layout, fp8_split
from .zero12 import ReduceScatter, Zero2


def in_backward() -> bool:
    """True while the autograd engine is running a backward pass (e.g. a recompute forward)."""
    return torch._C._current_graph_task_id() != -1


class ShardedParams(ReduceScatter):
    """ZeRO-3's ``Sharding``: ZeRO-1/2's, but the shard is the only parameter copy between
    uses (no all-gather after the step: each unit is gathered from it before its next use)."""

    def gather_params(self, buckets: list[Bucket]) -> None:
        """No gather: each unit is gathered from its shard before its next forward."""

    def param_state(self, b: Bucket) -> torch.Tensor:
        return b.param_shard


class UnitLayout(Layout):
    """One bucket per (gather unit, group), in backward order; built gathered, then freed."""

    def runs(self, named: list[Named], units: list[nn.Module] | None
             ) -> list[tuple[int, list[Named]]]:
        """Backward order: the last unit first, ..., the first unit, then the root (whose
        embedding gradient is the last to arrive); one bucket per (unit, group)."""
        units = units or []
        name_of = {id(p): n for n, p in named}
        per_unit = [[(name_of[id(p)], p) for p in u.parameters() if id(p) in name_of]
                    for u in units]
        in_unit = {id(p) for run in per_unit for _, p in run}
        root = [(n, p) for n, p in named if id(p) not in in_unit]
        return [(i, list(reversed(per_unit[i]))) for i in reversed(range(len(units)))] + [
            (len(units), list(reversed(root)))]

    def split(self, run: list[Named]) -> list[list[Named]]:
        """The run whole; with the fp8 gather (``fp8.Fp8Gather``) its fp8 linears' weights
        first, then the rest (``layout.fp8_split``)."""
        return fp8_split(run, self.par)

    def own_shard(self, flat: torch.Tensor, b: Bucket) -> torch.Tensor:
        """A copy: the full flat buffer is freed after each use, the shard must outlive it."""
        return flat[b.lo:b.hi].clone()

    def fill(self, b: Bucket) -> None:
        """Built gathered, its shard kept, then freed at once: the build's transient is one
        bucket (one gather unit), never the rank's whole model."""
        super().fill(b)
        b.param_full.untyped_storage().resize_(0)


class GatherUnit:
    """A set of buckets (one per reduction group) gathered and freed together."""

    def __init__(self, name: str, buckets: list[Bucket]):
        self.name, self.buckets = name, buckets
        self.state = "free"  # free | inflight | full
        self.handles: list[Any] = []
        self.nparams = sum(len(b.params) for b in buckets)
        self.done = 0


class UnitGather:
    """ZeRO-3's ``ParamGather``: per-unit all-gather with prefetch, driven by module hooks
    (pp = 1) or by the pipeline executor (pp > 1: ``begin_compute`` / ``end_compute``)."""

    def __init__(self, model: nn.Module, units: list[nn.Module] | None, buckets: list[Bucket],
                 par: Any, buffers: Buffers):
        # with pp the executor drives the gathers (``begin_compute``/``end_compute``): the units
        # are the rank's pipeline chunks (stages), not its blocks
        self.driven = par.pp > 1
        self.per_step = self.driven and par.zero3_pp_gather == "step"
        self.overlap = bool(par.overlap)
        self.buffers = buffers
        self.fp8: Fp8Gather | None = None  # the fp8 weights' gather (``Zero3`` sets it)
        units = list(units or [])
        nb = len(units)
        per_unit: list[list[Bucket]] = [[] for _ in range(nb + 1)]
        for b in buckets:
            per_unit[b.unit].append(b)
        self.units = [GatherUnit(f"unit{i}", per_unit[i]) for i in range(nb)]
        self.root = GatherUnit("root", per_unit[nb])
        self.unit_of: dict[int, GatherUnit] = {}
        for u in self.units + [self.root]:
            for b in u.buckets:
                self.unit_of[b.index] = u
        if self.driven:
            return
        for i, m in enumerate(units):
            m.register_forward_pre_hook(self._pre_forward(i))
            m.register_forward_hook(self._post_forward(i))
        model.register_forward_pre_hook(self._root_pre_forward)
        model.register_forward_hook(self._root_post_forward)

    # ------------------------------------------------------------------ gather / free
    def prefetch(self, u: GatherUnit, ahead: bool = False) -> None:
        """Start unit u's all-gather asynchronously; ``ahead`` (a prefetch) is off with
        --no-overlap."""
        if u.state != "free" or (ahead and not self.overlap):
            return
        for b in u.buckets:
            if self.fp8 is not None and self.fp8.owns(b):  # e4m3, with its scales
                u.handles += self.fp8.start(b, self._fp8_roles(u))
                self.buffers.hold(self.fp8.nbytes(b))
                continue
            b.param_full.untyped_storage().resize_(b.padded * b.param_full.element_size())
            self.buffers.hold(nbytes(b.param_full))
            u.handles.append(ops.all_gather_into(b.param_full, b.param_shard, b.group,
                                                 async_op=True))
        u.state = "inflight"

    def _fp8_roles(self, u: GatherUnit) -> tuple[str, ...]:
        """The weight operands a gather of unit u serves (``fp8.Fp8Gather.start``; rowwise
        gathers a cast per operand): a block's forward gather the forward's (Wᵀ), its backward
        gather the dgrad's (W) — and the forward's too under full recompute, whose backward
        reruns the forward —; the root and the executor's chunks both."""
        if u is self.root or self.driven:
            return ("w_fwd", "w_dgrad")
        if not in_backward():
            return ("w_fwd",)
        return ("w_fwd", "w_dgrad") if self.fp8 is not None and self.fp8.recompute else (
            "w_dgrad",)

    def gather(self, u: GatherUnit) -> None:
        self.prefetch(u)
        if u.state == "inflight":
            for h in u.handles:
                h.wait()
            u.handles = []
            u.state = "full"

    def free(self, u: GatherUnit) -> None:
        if u.state == "free":
            return
        if u.state == "inflight":
            for h in u.handles:
                h.wait()
            u.handles = []
        for b in u.buckets:
            if self.fp8 is not None and self.fp8.owns(b):
                self.buffers.release(self.fp8.nbytes(b))
                self.fp8.free(b)
                continue
            self.buffers.release(nbytes(b.param_full))
            b.param_full.untyped_storage().resize_(0)
        u.state = "free"

    # ------------------------------------------------------------------ module hooks (pp = 1)
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if in_backward():
            return
        self.gather(self.root)
        if self.units:
            self.prefetch(self.units[0], ahead=True)

    def _root_post_forward(self, module: nn.Module, args: Any, out: Any) -> None:
        """The root stays gathered when a backward follows: the loss's backward starts with
        the head, which would gather it again at once (FSDP2 keeps its root the same way);
        one all-gather of the root a micro-batch fewer, no byte more at any moment."""
        if in_backward():
            return
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(self._pre_backward(len(self.units)))
        else:  # evaluation: no backward comes
            self.free(self.root)

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

    # ------------------------------------------------------------------ the ParamGather protocol
    def begin_compute(self, chunk: int, kind: str) -> None:
        """Before a pipeline action on chunk ``chunk`` (F or B; W reads no weight): gather the
        chunk. Per step, the first call starts every chunk's all-gather (overlapping the
        first forward with the rest)."""
        if kind == "W":
            return
        if self.per_step:
            for u in self.units:
                self.prefetch(u, ahead=True)
        self.gather(self.units[chunk])

    def end_compute(self, chunk: int, kind: str, next_chunk: int | None = None) -> None:
        """After the action: per micro-batch, free the chunk again and start the all-gather of
        the chunk the next F or B needs (it overlaps the receives in between; off with
        --no-overlap); per step: keep it."""
        if kind != "W" and not self.per_step:
            self.free(self.units[chunk])
            if next_chunk is not None:
                self.prefetch(self.units[next_chunk], ahead=True)

    def after_grad(self, b: Bucket, j: int) -> None:
        if self.driven:
            return
        u = self.unit_of[b.index]
        u.done += 1
        if u.done == u.nparams:  # the unit's backward is complete on this micro-batch
            u.done = 0
            self.free(u)

    def after_finish(self) -> None:
        for u in self.units + [self.root]:
            u.done = 0
            self.free(u)

    def end_forward(self) -> None:
        """After an evaluation pass: free every unit still gathered (``--zero3-pp-gather
        step`` keeps them to the end of the pass; the hooks free the others already)."""
        for u in self.units + [self.root]:
            self.free(u)

    def reset(self) -> None:
        for u in self.units + [self.root]:
            u.done = 0
        if self.fp8 is not None:
            self.fp8.stale()


def _then(fn: Any, after: Any) -> Any:
    """``fn``, then ``after()``."""
    def call(*args: Any, **kw: Any) -> Any:
        out = fn(*args, **kw)
        after()
        return out
    return call


class Zero3(Zero2):
    """Sharded parameters, gradients and optimizer state; per-unit gather with prefetch."""

    stage = 3
    sharding_type = ShardedParams
    layout_type = UnitLayout
    gather_type = UnitGather
    # the gather units and their gather/prefetch, for figures (fived.viz.fsdp wraps the latter)
    units = Alias("gathers")
    root = Alias("gathers")
    prefetch = Alias("gathers")
    gather = Alias("gathers")

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        fp8 = Fp8Gather.of(self.buckets, self.placements, self.grid, self.par,
                           self.gathers.buffers)
        self.gathers.fp8 = fp8
        if fp8 is not None:  # the shards change there: the fp8 gather's scales are taken again
            for name in ("step", "publish_params"):
                setattr(self.masters, name, _then(getattr(self.masters, name), fp8.stale))
