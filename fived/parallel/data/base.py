"""The data-parallel engine: ``DataParallel`` composes, for one ZeRO stage, pieces with one job
each, and is the public surface the trainer, the pipeline executor, checkpoints and tests use
(docs/engine.md has the table):

    layout.Layout / zero3.UnitLayout   the buckets, built and filled on the device (born sharded)
    protocols.Sharding                 shards per bucket, the reduction collective, the
                                       parameters' publication (ddp.AllReduce,
                                       zero12.ReduceScatter, zero3.ShardedParams)
    protocols.GradStore                the gradient buffer's life (grads.FullGrads, ShardGrads)
    reduce.Reduction                   hooks, launch order, overlap, ``finish``
    master.MasterStep                  masters, loss scale, norm, clip, optimizer step
    accounting.StateAccount, Buffers   model-state bytes (``memory``), the buffers' peak
    protocols.ParamGather              whole parameters when (protocols.NoGather; ZeRO-3's
                                       zero3.UnitGather)

A stage class (``DDP``, ``Zero1``, ``Zero2``, ``Zero3``) only names its pieces. Model-state
bytes per rank (Ψ parameters; P, G, M = param, grad, fp32-master bytes; 8 = Adam m and v):

    ZeRO-0: (P + G + M + 8)·Ψ        ZeRO-1: (P + G)·Ψ + (M + 8)·Ψ/N
    ZeRO-2: P·Ψ + (G + M + 8)·Ψ/N    ZeRO-3: (P + G + M + 8)·Ψ/N      (+ padding; accounting)

Three methods are the stage's seams, called by the pieces through the engine so that a test or
a figure can wrap them there: ``build_grads`` (the layout, per bucket), ``ensure_grad`` and
``start_reduce`` (the reduction).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..placement import Placement, replicated
from ..precision import MasterPolicy
from .accounting import Buffers, StateAccount
from .buckets import Bucket
from .grads import FullGrads
from .layout import Layout
from .master import MasterStep
from .protocols import NoGather
from .reduce import Reduction


class Alias:
    """``engine.NAME`` is ``engine.PIECE.NAME`` (or ``.ATTR``), read and written: one line of the
    public surface. Writing it (a figure wrapping ``engine.wait``, a bench swapping
    ``engine.opt``) replaces the piece's own, so the piece's internal calls see it too."""

    def __init__(self, piece: str, attr: str = ""):
        self.piece, self.attr = piece, attr

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = self.attr or name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self.piece), self.attr)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(getattr(obj, self.piece), self.attr, value)


class DataParallel:
    """One ZeRO stage's engine: the pieces its subclass names, composed, and the public surface.
    ``self.buckets`` (``buckets.Bucket``, launch order) is shared by every piece."""

    stage = -1  # the ZeRO stage, for display
    sharding_type: Any = None  # protocols.Sharding: the stage must say
    grads_type: Any = FullGrads  # protocols.GradStore
    layout_type: Any = Layout
    gather_type: Any = NoGather  # protocols.ParamGather

    # ---------------------------------------------------------------- the public surface
    # the trainer, per step (zero_grad and close are methods below)
    set_last_micro = Alias("reduction")
    finish = Alias("reduction")
    clip = Alias("masters")
    step = Alias("masters")
    skip_reason = Alias("masters")
    overflow = Alias("masters")
    scaler = Alias("masters")
    memory = Alias("account")
    # the pipeline executor and evaluation (ZeRO-3's gathers; no-ops for stages 0-2)
    begin_compute = Alias("gathers")
    end_compute = Alias("gathers")
    end_forward = Alias("gathers")
    # checkpoints, the dry run, benches, tests
    opt = Alias("masters")
    sr_gen = Alias("masters")
    publish_params = Alias("masters")
    unscale = Alias("masters")
    grad_sq = Alias("masters")
    owned_sq = Alias("masters")
    owned_grads = Alias("masters")
    full_grads = Alias("masters")
    full_params = Alias("masters")
    measure_rounding = Alias("masters")
    rounding = Alias("masters")
    grad_state = Alias("grads", "state")
    param_state = Alias("sharding")
    param_extra = Alias("sharding")
    wait = Alias("reduction")
    hold = Alias("buffers")
    release = Alias("buffers")

    def __init__(self, model: nn.Module, grid: Any, par: Any, train: Any,
                 placements: dict[str, Placement] | None = None,
                 units: list[nn.Module] | None = None, source: Any = None,
                 device: torch.device | None = None):
        """``placements``: every trainable parameter's, by name (None: all replicated, dense);
        ``units``: ZeRO-3's gather units in forward order (ignored by the other stages);
        ``source``: what fills parameters still on the meta device (``fived.model.init.
        InitSource``, ``fived.checkpoint.hf.HFSource``; None: they stay as they are), written
        straight into the flat buffers on ``device`` (default: the parameters' device)."""
        self.model, self.grid, self.par, self.train, self.source = model, grid, par, train, source
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        # every buffer the engine makes lives on the parameters' device (cuda on the GPU path)
        self.device = (torch.device(device) if device is not None else
                       self.params[0].device if self.params else torch.device("cpu"))
        self.placements = dict(replicated(named)) if placements is None else placements
        missing = [n for n, _ in named if n not in self.placements]
        if missing:
            raise ValueError(f"no Placement for parameters {missing}")
        self.policy = MasterPolicy.of(self.params[0].dtype if self.params else torch.float32,
                                      par.grad_reduce_dtype,
                                      getattr(par, "master_weights", "fp32"))
        # ZeRO shards start and end on whole rows (``--zero-align rows``)
        align = getattr(par, "zero_align", "none") == "rows" and self.stage > 0
        self.buffers = Buffers()
        self.sharding = self.sharding_type(grid, par, self.device)
        self.grads = self.grads_type(self.policy, self.device, self.buffers)
        self.buckets: list[Bucket] = self.layout_type(
            grid, par, self.placements, self.policy, self.device, source, self.sharding,
            align).build(named, units, self.build_grads)
        self.masters = MasterStep(model, self.buckets, self.placements, grid, train,
                                  self.policy, self.sharding, self.device, align)
        self.account = StateAccount(self.buckets, self.sharding, self.grads, self.masters,
                                    self.buffers)
        self.gathers = self.gather_type(model, units, self.buckets, par, self.buffers)
        self.reduction = Reduction(self, self.buckets, self.grads, self.gathers, grid, par)
        self.zero_grad()

    def zero_grad(self) -> None:
        """Start of a step: gradients reset, nothing launched, no overflow, the peak restarts."""
        self.reduction.reset()
        self.masters.reset()
        self.buffers.reset()
        self.gathers.reset()

    def close(self) -> None:
        """Remove the gradient hooks. A parameter's hook is a bound method of the engine's
        reduction (which holds the engine), kept in C++ where the garbage collector cannot see
        the cycle: without this the engine, its grid and their process groups outlive the
        trainer, and a gloo worker thread of theirs can abort the interpreter at exit
        (fived.ranks.launch.teardown)."""
        self.reduction.close()

    # ---------------------------------------------------------------- the stage's seams
    def build_grads(self, b: Bucket) -> None:
        """Bucket ``b``'s gradient storage, at build time (the ``GradStore``'s)."""
        self.grads.build(b)

    def ensure_grad(self, b: Bucket) -> torch.Tensor:
        """Bucket ``b``'s full gradient buffer (allocated here when it is transient)."""
        return self.grads.ensure(b)

    def start_reduce(self, b: Bucket) -> Any:
        """Start bucket ``b``'s reduction asynchronously (the ``Sharding``'s); its handle."""
        return self.sharding.start_reduce(b)
