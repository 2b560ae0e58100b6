"""Master weights and the step: the precision policy (``fived.parallel.precision.MasterPolicy``),
the fp16 loss scale, the global gradient norm and clipping, the optimizer step on the owned
fp32 masters, and writing the result back into the compute-dtype parameters.

Per step, on the owned shard of every bucket (g: the reduced gradient, θ: the master):

    fp16:  g ← g / S  (once; S the loss scale)
    norm   = sqrt(Σ_groups Σ_pieces w·Σg²)   (w = parts/tp: each element counted once;
             ZeRO sums the members' shards, ``Sharding.sum_over_shards``; ``fived.optim.clip``)
    clip:  g ← g · max_norm / norm  when norm > max_norm
    a non-finite norm: overflow, no update (fp16: S halves, the reason in ``skip_reason``)
    step:  θ ← optimizer(θ, g, lr)   (``--optimizer``: ``fived.optim.make_optimizer``, given
           each bucket's ``Piece`` table by ``optimizer_pieces``)
    then:  params ← round(θ) on the owned shard, and the ``Sharding`` publishes them
           (ZeRO-1/2 all-gather; ZeRO-0 holds everything; ZeRO-3 gathers before use)

Master bytes per parameter: fp32 compute 0 (the parameters are the master), an fp32 master 4;
without one (``--master-weights none|sr|kahan``, bf16) the optimizer steps a transient fp32
working copy θ (+ Kahan's bf16 compensation c, 2 bytes) written back by
``fived.parallel.precision.write_back``.
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
from ..placement import Placement
from ..precision import loss_scaler, write_back
from .buckets import Bucket


def optimizer_pieces(buckets: list[Bucket], placements: dict[str, Placement]
                     ) -> list[BucketPieces]:
    """Every bucket's parameters as ``fived.optim.Piece``s: the local and global matrix, the tp
    cut (from the ``Placement``) and the elements this rank owns."""
    out = []
    for b in buckets:
        pieces = []
        for j, (name, p) in enumerate(zip(b.names, b.params)):
            pl = placements[name]
            off, n = b.offsets[j], p.numel()
            a, e = max(off, b.lo), min(off + n, b.hi)
            if a >= e:
                a = e = b.lo
                off_a, off_e = 0, 0
            else:
                off_a, off_e = a - off, e - off
            # the matrix's cut dimension: a 1-D parameter (a cut q/k/v bias) is one row, cut
            # along its columns
            mdim = pl.dim if len(pl.shape) > 1 else 1
            pieces.append(Piece(name, matrix_shape(tuple(p.shape)), matrix_shape(pl.shape),
                                mdim, pl.parts, pl.index, off, off_a, off_e, a - b.lo,
                                e - b.lo, ndim=len(pl.shape)))
        out.append(BucketPieces(b.index, b.group_name, b.group, b.shards > 1, b.shard_numel,
                                b.padded, pieces))
    return out


class MasterStep:
    """The owned masters (``b.master``, ``b.comp``), the optimizer, the loss scaler; unscale,
    norm, clip, step, publish."""

    def __init__(self, model: nn.Module, buckets: list[Bucket],
                 placements: dict[str, Placement], grid: Any, train: Any, policy: Any,
                 sharding: Any, device: torch.device, align_rows: bool):
        self.buckets, self.grid, self.policy = buckets, grid, policy
        self.sharding, self.device = sharding, device
        self.measure_rounding = False  # numerics experiments: count updates lost to rounding
        self.rounding = {"moved": 0, "lost": 0}
        self.sr_gen = torch.Generator().manual_seed(int(train.seed) * 1_000_003
                                                    + getattr(grid, "rank", 0))
        self.scaler = loss_scaler(model, policy.compute)
        self.overflow = False
        self.unscaled = False  # fp16: gradients already divided by the loss scale this step
        self.skip_reason: str | None = None
        for b in buckets:
            b.master = (b.param_shard.float().clone() if policy.separate_master
                        else b.param_shard)
            if policy.in_place:  # shapes the optimizer's state; dropped after it is built
                b.master = b.param_shard.float()
            b.comp = (torch.zeros_like(b.param_shard) if policy.master == "kahan"
                      and policy.in_place else None)
        self.opt = make_optimizer(getattr(train, "optimizer", "adamw"),
                                  [b.master for b in buckets],
                                  optimizer_pieces(buckets, placements), grid, train,
                                  aligned_rows=align_rows)
        if policy.in_place:  # no master: the optimizer gets a working copy per step
            for b in buckets:
                b.master = None
            self.opt.params = [torch.empty(0) for _ in buckets]

    def reset(self) -> None:
        self.overflow = False
        self.unscaled = False
        self.skip_reason = None

    def owned_grads(self) -> list[torch.Tensor]:
        return [b.grad_shard for b in self.buckets]

    def owned_sq(self) -> dict[str, torch.Tensor]:
        """This rank's Σ g² of its owned gradient elements per group (dense, expert), summed
        over nothing yet (``fived.optim.clip``: each element counted once in the whole)."""
        sums = {"dense": torch.zeros((), dtype=torch.float64, device=self.device),
                "expert": torch.zeros((), dtype=torch.float64, device=self.device)}
        for b in self.buckets:
            accumulate_sq(sums[b.group_name], b.weighted_pieces())
        return sums

    def grad_sq(self) -> torch.Tensor:
        """Σ g² over the whole model, each element counted once (``fived.optim.clip``)."""
        sums = self.owned_sq()
        # summed over the shards only where this rank has buckets of the group: every member of
        # a group holds the same stage, so all of them skip it alike (a model without experts
        # would otherwise all-reduce a zero over the expert group every step)
        held = {b.group_name for b in self.buckets}
        self.sharding.sum_over_shards({k: v for k, v in sums.items() if k in held})
        return model_parallel_sq(sums["dense"], sums["expert"], self.grid)

    def unscale(self) -> None:
        """fp16: divide the owned gradients by the loss scale (once per step)."""
        if self.scaler is not None and not self.unscaled:
            scale_(self.owned_grads(), 1.0 / self.scaler.scale)
            self.unscaled = True

    def clip(self, max_norm: float, total_sq: torch.Tensor | None = None) -> float:
        """Unscale, take the global norm, clip to ``max_norm``; the norm (inf/nan: overflow).
        ``total_sq``: the global Σ g², already summed by the caller (the trainer carries a
        dense model's owned Σ g² in its loss all-reduce: ``Trainer.step``)."""
        self.unscale()
        norm = float((self.grad_sq() if total_sq is None else total_sq).sqrt())
        if not math.isfinite(norm):
            self.overflow = True
            return norm
        coef = clip_coef(norm, max_norm)
        if coef is not None:
            scale_(self.owned_grads(), coef)
        return norm

    def step(self, lr: float) -> bool:
        """The optimizer on the owned fp32 masters; False (and no update) after an overflow,
        with the reason in ``skip_reason`` for fp16 (the scale backs off)."""
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
        self.sharding.gather_params(self.buckets)

    def count_rounding(self, lost: list[torch.Tensor], moved: list[torch.Tensor]) -> None:
        """Owned elements whose optimizer update moved the fp32 value but not the stored one."""
        self.rounding = {"moved": int(sum(int(m.sum()) for m in moved)),
                         "lost": int(sum(int(x.sum()) for x in lost))}

    def publish_params(self) -> None:
        """Write the updated masters back into the compute-dtype parameters (also after a
        checkpoint load)."""
        if self.policy.separate_master:
            for b in self.buckets:
                b.param_shard.copy_(b.master)
        self.sharding.gather_params(self.buckets)

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

    def full_grads(self) -> dict[str, torch.Tensor]:
        """After ``finish()`` (and before ``clip``): each parameter's reduced gradient, as this
        rank's piece of it (tp/ep cuts stay), whole over the ZeRO group, unscaled (fp16), in
        fp32, keyed by name. ZeRO shards are all-gathered under the group name ``metrics``."""
        factor = 1.0 / self.scaler.scale if self.scaler is not None and not self.unscaled else 1.0
        out = {}
        for b in self.buckets:
            flat = self.sharding.gather_grad(b)
            for j, name in enumerate(b.names):
                g = b.view(flat, j).detach().to(torch.float32, copy=True)
                out[name] = g.mul_(factor) if factor != 1.0 else g
        return out
