"""The shared base of the data-parallel engines (DDP in ``ddp``, ZeRO-1/2 in ``zero12``, ZeRO-3
in ``zero3``): flat buckets, the gradient hooks and launch order, ``finish``, the global norm,
clipping and the optimizer step on fp32 masters (``--optimizer``: ``fived.optim.make_optimizer``,
which gets each bucket's ``Piece`` table from ``optimizer_pieces``; without a master,
``--master-weights none|sr|kahan``, it steps a transient fp32 working copy: ``step_in_place``),
and the memory report.

Every rank computes the gradient of Σ_local-tokens CE / global_tokens, so the *sum* over the
data-parallel group is exactly the one-rank gradient (no averaging, any number of micro-batches).

Each parameter's ``Placement`` (``fived.parallel.placement``, keyed by its name in
``model.named_parameters()``) says its reduction group — ``dense`` (dp·ep·cp) or ``expert``
(dp·cp) — and the model-parallel groups (``grad_sum``) over which its gradient is partial and
summed first. Parameters are laid out in flat *buckets* (``buckets``) in launch order, reverse
registration order (≈ the order backward produces their gradients) unless an engine says
otherwise. A post-accumulate-grad hook counts each bucket's gradients; on the last
micro-batch's backward a bucket whose gradients are all there starts its reduction
asynchronously (buckets start strictly in order per group, so every rank issues the same
collectives in the same sequence), and communication overlaps the rest of backward.
``finish()`` starts whatever is left and waits for everything; ``--no-overlap`` does the same
reductions after backward.

Model-state bytes per rank (Ψ parameters; P = param bytes, G = grad bytes, M = 4 for an fp32
master or 0, 8 for Adam m and v; ``memory()`` reports each key from the tensors held):

    ZeRO-0: (P + G + M + 8)·Ψ        ZeRO-1: (P + G)·Ψ + (M + 8)·Ψ/N
    ZeRO-2: P·Ψ + (G + M + 8)·Ψ/N    ZeRO-3: (P + G + M + 8)·Ψ/N

plus ``padding`` (a full buffer's pad, a shard's pad/N), so every rank's keys = formula + padding
exactly; ``buffers`` is the step's peak of transient buffers (ZeRO-2/3).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ...comm import ops
from ...optim import (
    BucketPieces,
    Piece,
    accumulate_sq,
    clip_coef,
    make_optimizer,
    matrix_shape,
    model_parallel_sq,
    scale_,
)
from ..placement import Placement, replicated
from ..precision import MasterPolicy, loss_scaler, write_back
from .buckets import Bucket, Named, by_group, nbytes, split_buckets


class DataParallel:
    """What DDP and ZeRO-1/2/3 share. A subclass says how a bucket is reduced
    (``start_reduce``), how many shards it has (``shard_count``), and, where it differs from
    the defaults here (persistent full gradients, replicated parameters, size-capped buckets in
    reverse registration order), how gradients and parameters are stored."""

    stage = -1  # the ZeRO stage, for display

    def __init__(self, model: nn.Module, grid: Any, par: Any, train: Any,
                 placements: dict[str, Placement] | None = None,
                 units: list[nn.Module] | None = None, source: Any = None,
                 device: torch.device | None = None):
        """``placements``: every trainable parameter's, by name (None: all replicated, dense);
        ``units``: ZeRO-3's gather units in forward order (ignored by the other stages);
        ``source``: what fills parameters still on the meta device (``fived.model.init.
        InitSource``, ``fived.checkpoint.hf.HFSource``; None: they stay as they are), written
        straight into the flat buffers on ``device`` (default: the parameters' device)."""
        self.source = source
        self.model, self.grid, self.par, self.train = model, grid, par, train
        self.overlap = bool(par.overlap)
        self.last_micro = True
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
        self.measure_rounding = False  # numerics experiments: count updates lost to rounding
        self.rounding = {"moved": 0, "lost": 0}
        self.sr_gen = torch.Generator().manual_seed(int(train.seed) * 1_000_003 + getattr(grid, "rank", 0))
        self.scaler = loss_scaler(model, self.policy.compute)
        self.overflow = False
        self.unscaled = False  # fp16: gradients already divided by the loss scale this step
        self.skip_reason: str | None = None
        self.live_buffers = 0
        self.peak_buffers = 0
        self.buckets: list[Bucket] = []
        self.order: dict[str, list[Bucket]] = {}  # launch order per group
        self.next: dict[str, int] = {}
        for unit, run in self.layout(named, units):
            self.add_buckets(run, unit)
        for b in self.buckets:
            self.build_state(b)
        self.where: dict[int, tuple[Bucket, int]] = {}
        self.hooks = []  # the parameters' hooks hold the engine (a cycle through C++): close()
        for b in self.buckets:
            for j, p in enumerate(b.params):
                self.where[id(p)] = (b, j)
                self.hooks.append(p.register_post_accumulate_grad_hook(self.grad_ready))
        self.opt = make_optimizer(getattr(train, "optimizer", "adamw"),
                                  [b.master for b in self.buckets], self.optimizer_pieces(),
                                  grid, train, aligned_rows=self.aligned_rows())
        if self.policy.in_place:  # no master: the optimizer gets a working copy per step
            for b in self.buckets:
                b.master = None
            self.opt.params = [torch.empty(0) for _ in self.buckets]
        self.zero_grad()

    # ------------------------------------------------------------------ the optimizer's view
    def aligned_rows(self) -> bool:
        """ZeRO shards start and end on whole rows (``--zero-align rows``)."""
        return getattr(self.par, "zero_align", "none") == "rows" and self.stage > 0

    def optimizer_pieces(self) -> list[BucketPieces]:
        """Every bucket's parameters as ``fived.optim.Piece``s: the local and global matrix,
        the tp cut (from the ``Placement``) and the elements this rank owns."""
        out = []
        for b in self.buckets:
            pieces = []
            for j, (name, p) in enumerate(zip(b.names, b.params)):
                pl = self.placements[name]
                off, n = b.offsets[j], p.numel()
                a, e = max(off, b.lo), min(off + n, b.hi)
                if a >= e:
                    a = e = b.lo
                    off_a, off_e = 0, 0
                else:
                    off_a, off_e = a - off, e - off
                # the matrix's cut dimension: a 1-D parameter (a cut q/k/v bias) is one row,
                # cut along its columns
                mdim = pl.dim if len(pl.shape) > 1 else 1
                pieces.append(Piece(name, matrix_shape(tuple(p.shape)), matrix_shape(pl.shape),
                                    mdim, pl.parts, pl.index, off, off_a, off_e, a - b.lo,
                                    e - b.lo, ndim=len(pl.shape)))
            out.append(BucketPieces(b.index, b.group_name, b.group, b.shards > 1,
                                    b.shard_numel, b.padded, pieces))
        return out

    def full_params(self) -> dict[str, torch.Tensor]:
        """Each parameter's fp32 master as this rank's piece (tp/ep cuts stay), whole over the
        ZeRO group (all-gathered under ``metrics``), keyed by name (tests)."""
        out = {}
        for b in self.buckets:
            flat = b.master.float() if b.master is not None else self.working_copy(b)
            if b.shards > 1:
                full = torch.empty(b.padded, dtype=torch.float32)
                ops.all_gather_into(full, flat.contiguous(), replace(b.group, name="metrics"))
                flat = full
            for j, name in enumerate(b.names):
                out[name] = b.view(flat, j).detach().clone()
        return out

    # ------------------------------------------------------------------ what a stage says
    def shard_count(self, group: Any) -> int:
        """Equal shards of each bucket over its group (1: every member holds everything)."""
        raise NotImplementedError

    def start_reduce(self, b: Bucket) -> Any:
        """Start bucket ``b``'s reduction asynchronously; its handle."""
        raise NotImplementedError

    def sum_over_shards(self, sums: dict[str, torch.Tensor]) -> None:
        """Add up the per-group Σg² of the members owning disjoint shards (none: replicated)."""

    def gather_grad(self, b: Bucket) -> torch.Tensor:
        """Bucket ``b``'s whole reduced gradient (padded flat), for ``full_grads``."""
        return b.grad_shard

    def gather_params(self) -> None:
        """After the step: bring every member's updated shard into the full parameters."""

    # ------------------------------------------------------------------ layout
    def layout(self, named: list[Named], units: list[nn.Module] | None
               ) -> list[tuple[int, list[Named]]]:
        """(unit, parameters) runs in launch order; each is split by group, then ``split``."""
        return [(-1, list(reversed(named)))]

    def split(self, run: list[Named]) -> list[list[Named]]:
        esize = torch.empty((), dtype=self.policy.grad).element_size()
        return split_buckets(run, max(1, int(self.par.bucket_mb * 2**20 / esize)))

    def add_buckets(self, run: list[Named], unit: int) -> None:
        tp = self.grid.degrees["tp"]
        for name, items in by_group(run, self.placements).items():
            group = self.grid[name]
            for piece in self.split(items):
                b = Bucket(piece, [self.placements[n] for n, _ in piece], name, group,
                           self.shard_count(group), len(self.buckets), tp, unit,
                           align_rows=self.aligned_rows())
                self.buckets.append(b)
                self.order.setdefault(name, []).append(b)

    def build_state(self, b: Bucket) -> None:
        """Flat parameters (``p.data`` become views), the master and the gradient storage."""
        flat = torch.zeros(b.padded, dtype=self.policy.compute, device=self.device)
        with torch.no_grad():
            for j, p in enumerate(b.params):
                view = b.view(flat, j)
                if p.is_meta and not flat.is_meta:  # born sharded: only this rank's piece
                    if self.source is not None:
                        pl = self.placements[b.names[j]]
                        self.source.fill(view, pl.name, pl.shape, pl.dim, pl.parts, pl.index)
                    # the module keeps its Parameter object, moved off meta (``.data`` cannot
                    # change the device); then, as for any parameter, a view of the buffer
                    torch.utils.swap_tensors(p, nn.Parameter(view.new_empty(0), p.requires_grad))
                else:
                    view.copy_(p.detach())
                p.data = view
        b.param_full = flat
        b.param_shard = self.own_shard(flat, b)
        b.master = b.param_shard.float().clone() if self.policy.separate_master else b.param_shard
        if self.policy.in_place:  # shapes the optimizer's state; dropped after it is built
            b.master = b.param_shard.float()
        b.comp = (torch.zeros_like(b.param_shard) if self.policy.master == "kahan"
                  and self.policy.in_place else None)
        self.build_grads(b)

    def own_shard(self, flat: torch.Tensor, b: Bucket) -> torch.Tensor:
        """This rank's slice of a bucket's flat parameters: a view (the full buffer stays)."""
        return flat[b.lo:b.hi]

    # ------------------------------------------------------------------ gradient storage
    # the defaults: a persistent full gradient buffer per bucket (DDP, ZeRO-1)
    def build_grads(self, b: Bucket) -> None:
        b.grad = torch.zeros(b.padded, dtype=self.policy.grad, device=self.device)
        b.grad_shard = b.grad[b.lo:b.hi]

    def attach_grads(self) -> bool:
        """Whether ``p.grad`` are views of the full gradient buffer (autograd then accumulates
        in place); otherwise the hook copies each gradient in and drops it."""
        return self.policy.grad == self.policy.compute

    def reset_grads(self, b: Bucket) -> None:
        b.grad.zero_()
        attach = self.attach_grads()
        for j, p in enumerate(b.params):
            p.grad = b.view(b.grad, j) if attach else None

    def ensure_grad(self, b: Bucket) -> torch.Tensor:
        """Bucket ``b``'s full gradient buffer (allocated here when it is transient)."""
        return b.grad

    def after_launch(self, seq: list[Bucket], launched: int) -> None:
        """Called after the first ``launched`` buckets of a group's ``seq`` have started."""

    def after_reduce(self, b: Bucket) -> None:
        """Bucket ``b``'s reduction is complete."""

    def grad_state(self, b: Bucket) -> torch.Tensor:
        return b.grad

    def param_state(self, b: Bucket) -> torch.Tensor:
        return b.param_full

    # ------------------------------------------------------------------ hooks for ZeRO-3
    def begin_compute(self, chunk: int, kind: str) -> None:
        """The pipeline executor is about to run action ``kind`` (F, B, W) on chunk ``chunk``."""

    def end_compute(self, chunk: int, kind: str, next_chunk: int | None = None) -> None:
        """The pipeline executor has run action ``kind`` on chunk ``chunk``; its next F or B
        runs on ``next_chunk``."""

    def after_grad(self, b: Bucket, j: int) -> None:
        """A gradient of bucket ``b`` arrived (any micro-batch)."""

    def after_finish(self) -> None:
        """All reductions are complete."""

    def end_forward(self) -> None:
        """A forward-only pass (evaluation, ``torch.no_grad``) is over: release what it
        gathered. No gradient was made, so nothing is reduced."""

    # ------------------------------------------------------------------ buffers
    def hold(self, n: int) -> None:
        self.live_buffers += n
        self.peak_buffers = max(self.peak_buffers, self.live_buffers)

    def release(self, n: int) -> None:
        self.live_buffers -= n

    # ------------------------------------------------------------------ step pieces
    def close(self) -> None:
        """Remove the gradient hooks. A parameter's hook is a bound method of the engine, kept in
        C++ where the garbage collector cannot see the cycle: without this the engine, its grid
        and their process groups outlive the trainer, and a gloo worker thread of theirs can
        abort the interpreter at exit (fived.ranks.launch.teardown)."""
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.ready, b.launched, b.handle = 0, False, None
            self.reset_grads(b)
        self.next = {name: 0 for name in self.order}
        self.overflow = False
        self.unscaled = False
        self.skip_reason = None
        self.peak_buffers = self.live_buffers

    def set_last_micro(self, last: bool) -> None:
        """Called before each micro-batch's backward; reductions start only on the last one."""
        self.last_micro = last

    def grad_ready(self, p: nn.Parameter) -> None:
        """Post-accumulate-grad hook: move the gradient into its bucket; on the last
        micro-batch, count it and start every bucket that is complete, in order."""
        b, j = self.where[id(p)]
        if not self.attach_grads():
            g = p.grad
            if g is not None:
                b.view(self.ensure_grad(b), j).add_(g.detach())
                p.grad = None
        self.after_grad(b, j)
        if not self.last_micro or not self.overlap:
            return
        for name in b.grad_sum[j]:
            ops.all_reduce(b.view(self.ensure_grad(b), j), self.grid[name])
        b.ready += 1
        if b.ready == len(b.params):
            self.launch_ready(b.group_name)

    def launch_ready(self, name: str) -> None:
        seq = self.order[name]
        while self.next[name] < len(seq) and seq[self.next[name]].ready == len(
                seq[self.next[name]].params):
            self.launch(seq[self.next[name]])
            self.next[name] += 1
            self.after_launch(seq, self.next[name])

    def launch(self, b: Bucket) -> None:
        self.ensure_grad(b)
        b.handle = self.start_reduce(b)
        b.launched = True

    def wait(self, b: Bucket) -> None:
        if b.handle is not None:
            b.handle.wait()
            b.handle = None
        self.after_reduce(b)

    def reduce_replicated(self) -> None:
        """Sum gradients that are partial over model-parallel groups (``grad_sum``), e.g. norm
        weights under sequence parallelism (with overlap the hook does it)."""
        for b in self.buckets:
            for j, names in enumerate(b.grad_sum):
                for name in names:
                    ops.all_reduce(b.view(self.ensure_grad(b), j), self.grid[name])

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
        self.after_finish()

    # ------------------------------------------------------------------ gradients out
    def owned_grads(self) -> list[torch.Tensor]:
        return [b.grad_shard for b in self.buckets]

    def full_grads(self) -> dict[str, torch.Tensor]:
        """After ``finish()`` (and before ``clip``): each parameter's reduced gradient, as this
        rank's piece of it (tp/ep cuts stay), whole over the ZeRO group, unscaled (fp16), in
        fp32, keyed by name. ZeRO shards are all-gathered under the group name ``metrics``."""
        factor = 1.0 / self.scaler.scale if self.scaler is not None and not self.unscaled else 1.0
        out = {}
        for b in self.buckets:
            flat = self.gather_grad(b)
            for j, name in enumerate(b.names):
                g = b.view(flat, j).detach().to(torch.float32, copy=True)
                out[name] = g.mul_(factor) if factor != 1.0 else g
        return out

    # ------------------------------------------------------------------ norm, clip, step
    def grad_sq(self) -> torch.Tensor:
        """Σ g² over the whole model, each element counted once (``fived.optim.clip``)."""
        sums = {"dense": torch.zeros((), dtype=torch.float64, device=self.device),
                "expert": torch.zeros((), dtype=torch.float64, device=self.device)}
        for b in self.buckets:
            accumulate_sq(sums[b.group_name], b.weighted_pieces())
        self.sum_over_shards(sums)
        return model_parallel_sq(sums["dense"], sums["expert"], self.grid)

    def unscale(self) -> None:
        """fp16: divide the owned gradients by the loss scale (once per step)."""
        if self.scaler is not None and not self.unscaled:
            scale_(self.owned_grads(), 1.0 / self.scaler.scale)
            self.unscaled = True

    def clip(self, max_norm: float) -> float:
        """Unscale, take the global norm, clip to ``max_norm``; the norm (inf/nan: overflow)."""
        self.unscale()
        norm = float(self.grad_sq().sqrt())
        if not math.isfinite(norm):
            self.overflow = True
            return norm
        coef = clip_coef(norm, max_norm)
        if coef is not None:
            scale_(self.owned_grads(), coef)
        return norm

    def step(self, lr: float) -> bool:
        """AdamW on the owned fp32 masters; False (and no update) after an overflow, with the
        reason in ``skip_reason`` for fp16 (the scale backs off)."""
        if self.scaler is not None:
            old = self.scaler.scale
            self.scaler.update(self.overflow)
            if self.overflow:
                self.skip_reason = (f"fp16: gradient overflow at loss scale {old:g}; step "
                                    f"skipped, scale -> {self.scaler.scale:g}")
                return False
        elif self.overflow:
            return False
        with torch.no_grad():
            if self.policy.in_place:
                self.step_in_place(lr)
                return True
            before = ([b.param_shard.clone() for b in self.buckets] if self.measure_rounding
                      and self.policy.separate_master else None)
            olds = [b.master.clone() for b in self.buckets] if before is not None else None
            self.opt.step(self.owned_grads(), lr)
            self.publish_params()
            if before is not None:
                self.count_rounding([(b.master != o) & (b.param_shard == p)
                                     for b, o, p in zip(self.buckets, olds, before)],
                                    [b.master != o for b, o in zip(self.buckets, olds)])
        return True

    def working_copy(self, b: Bucket) -> torch.Tensor:
        """Without a master: the fp32 value the bf16 parameters (and Kahan's c) stand for."""
        w = b.param_shard.float()
        return w.add_(b.comp.float()) if b.comp is not None else w

    def step_in_place(self, lr: float) -> None:
        """``--master-weights none|sr|kahan``: step a transient fp32 working copy and write it
        back into the bf16 parameters (``fived.parallel.precision.write_back``)."""
        works = [self.working_copy(b) for b in self.buckets]
        self.opt.params = works
        self.opt.step(self.owned_grads(), lr)
        lost, moved = [], []
        for b, w in zip(self.buckets, works):
            old = self.working_copy(b)
            lost.append(write_back(b.param_shard, w, self.policy.master, b.comp, self.sr_gen))
            moved.append(w != old)
        self.opt.params = [torch.empty(0) for _ in self.buckets]
        if self.measure_rounding:
            self.count_rounding(lost, moved)
        self.gather_params()

    def count_rounding(self, lost: list[torch.Tensor], moved: list[torch.Tensor]) -> None:
        """Owned elements whose optimizer update moved the fp32 value but not the stored one."""
        self.rounding = {"moved": int(sum(int(m.sum()) for m in moved)),
                         "lost": int(sum(int(x.sum()) for x in lost))}

    def publish_params(self) -> None:
        """Write the updated masters back into the compute-dtype parameters."""
        if self.policy.separate_master:
            for b in self.buckets:
                b.param_shard.copy_(b.master)
        self.gather_params()

    # ------------------------------------------------------------------ accounting
    def state_tensors(self, i: int) -> list[torch.Tensor]:
        """Every model-state tensor of bucket ``i``: params, grads, master, Adam m and v."""
        b = self.buckets[i]
        out = [self.param_state(b), self.grad_state(b)]
        if self.policy.separate_master:
            out.append(b.master)
        if b.comp is not None:
            out.append(b.comp)
        return out + self.opt.flat_state(i)

    def padding_bytes(self) -> float:
        """Bytes of padding in the states this rank holds; a shard's padding is counted as its
        1/N share, so that every rank's bytes = formula(Ψ) + padding exactly."""
        total = 0.0
        for i, b in enumerate(self.buckets):
            if not b.pad:
                continue
            for t in self.state_tensors(i):
                per = t.element_size()
                total += b.pad * per if t.numel() == b.padded else b.pad * per / b.shards
        return total

    def memory(self) -> dict[str, Any]:
        """Bytes this rank holds, from the tensors themselves."""
        master = (sum(nbytes(b.master) for b in self.buckets)
                  if self.policy.separate_master else 0)
        master += sum(nbytes(b.comp) for b in self.buckets if b.comp is not None)
        return {
            "params": sum(nbytes(self.param_state(b)) for b in self.buckets),
            "grads": sum(nbytes(self.grad_state(b)) for b in self.buckets),
            "master": master,
            "optimizer": self.opt.state_bytes(),
            "buffers": self.peak_buffers,
            "padding": self.padding_bytes(),
        }
