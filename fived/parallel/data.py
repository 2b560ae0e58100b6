"""Data parallelism: gradients summed over the ranks that hold the same parameters (DDP), and the
one engine that also runs ZeRO-1/2/3 (``fived.parallel.zero``) and mixed precision
(``fived.parallel.precision``).

Every rank computes the gradient of Σ_local-tokens CE / global_tokens, so the *sum* over the
data-parallel group is exactly the one-rank gradient (no averaging, any number of micro-batches).

Dense parameters are reduced over the ``dense`` group (dp·ep·cp); expert parameters (attribute
``_fived_expert``) over the ``expert`` group (dp·cp). Parameters are laid out in flat *buckets*
in reverse registration order (≈ the order backward produces their gradients), at most
``par.bucket_mb`` MB each. A post-accumulate-grad hook counts each bucket's gradients; on the
last micro-batch's backward a bucket whose gradients are all there starts its all-reduce
asynchronously (buckets start strictly in order, so every rank issues the same collectives in
the same sequence), and communication overlaps the rest of backward. ``finish()`` starts
whatever is left and waits for everything. ``--no-overlap`` does the same reductions after
backward. Ring all-reduce:

    bytes sent per rank per step = 2·(N−1)/N · gradient bytes            (N = group size)

Model states, bytes per parameter (Ψ parameters) that this engine allocates with ZeRO-0:

    fp32:                 params 4 + grads 4 (fp32)           + Adam m, v 8 = 16Ψ
    bf16/fp16, fp32 grad: params 2 + grads 4 (fp32) + master 4 + Adam m, v 8 = 18Ψ  (default)
    bf16/fp16, low grad:  params 2 + grads 2 (compute dtype) + master 4 + m, v 8 = 16Ψ
                          (``grad_reduce_dtype = "bf16"``: reduce in the compute dtype)
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import ops
from .adam import FlatAdamW


def grad_group_name(p: nn.Parameter) -> str:
    return "expert" if getattr(p, "_fived_expert", False) else "dense"


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def in_backward() -> bool:
    """True while the autograd engine is running a backward pass (e.g. a recompute forward)."""
    return torch._C._current_graph_task_id() != -1


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class Bucket:
    """A contiguous run of parameters reduced over one group, on one flat buffer.

    With ``shards = N`` (ZeRO) the flat length is padded up to a multiple of N and member i of
    the group owns elements ``[i·S, (i+1)·S)``, ``S = padded / N``; with ``shards = 1`` (DDP)
    there is no padding and the rank "owns" everything.
    """

    def __init__(self, params: list[nn.Parameter], group_name: str, group: Any, shards: int,
                 index: int):
        self.params, self.group_name, self.group, self.index = params, group_name, group, index
        self.offsets: list[int] = []
        off = 0
        for p in params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        self.shards = shards
        self.padded = -(-off // shards) * shards
        self.pad = self.padded - off
        self.shard_numel = self.padded // shards
        member = group.rank if shards > 1 else 0
        self.lo, self.hi = member * self.shard_numel, (member + 1) * self.shard_numel
        self.ready = 0  # gradients produced in this (last micro-batch's) backward
        self.launched = False
        self.handle: Any = None
        # tensors, filled in by the engine
        self.param_full: torch.Tensor | None = None   # compute dtype, padded
        self.param_shard: torch.Tensor | None = None  # compute dtype, own shard (ZeRO)
        self.master: torch.Tensor | None = None       # fp32 owned elements (may alias params)
        self.grad: torch.Tensor | None = None         # full gradient buffer (padded)
        self.grad_shard: torch.Tensor | None = None   # owned gradient elements
        self.segments = self.owned_segments()

    def owned_segments(self) -> list[tuple[int, int, float]]:
        """(start, end, weight) of each parameter's part of the owned range, shard-relative;
        weight = ``_fived_tp_shards / tp`` is applied by the engine (here: the shard count)."""
        segs = []
        for p, off in zip(self.params, self.offsets):
            a, b = max(off, self.lo), min(off + p.numel(), self.hi)
            if a < b:
                segs.append((a - self.lo, b - self.lo, float(getattr(p, "_fived_tp_shards", 1))))
        return segs

    def view(self, flat: torch.Tensor, j: int) -> torch.Tensor:
        p = self.params[j]
        return flat[self.offsets[j]:self.offsets[j] + p.numel()].view_as(p)


def split_buckets(params: list[nn.Parameter], cap_elems: int) -> list[list[nn.Parameter]]:
    out: list[list[nn.Parameter]] = []
    cur: list[nn.Parameter] = []
    size = 0
    for p in params:
        if cur and size + p.numel() > cap_elems:
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.numel()
    if cur:
        out.append(cur)
    return out


class DataParallel:
    """DDP (``zero = 0``) and the shared machinery of ZeRO-1/2/3: buckets, hooks, clipping,
    AdamW on fp32 masters, the fp16 loss scaler and the memory report."""

    def __init__(self, model: nn.Module, grid: Any, par: Any, train: Any, zero: int | None = None):
        self.model, self.grid, self.par, self.train = model, grid, par, train
        self.zero = par.zero if zero is None else zero
        self.overlap = bool(par.overlap)
        self.last_micro = True
        params = [p for p in model.parameters() if p.requires_grad]
        self.params = params
        self.compute_dtype = params[0].dtype if params else torch.float32
        self.grad_dtype = (torch.float32 if par.grad_reduce_dtype == "fp32"
                           or self.compute_dtype == torch.float32 else self.compute_dtype)
        self.separate_master = self.compute_dtype != torch.float32
        from .precision import LossScaler, install_loss_scaling

        self.scaler = LossScaler() if self.compute_dtype == torch.float16 else None
        if self.scaler is not None:
            install_loss_scaling(model, self.scaler)
        self.overflow = False
        self.live_buffers = 0
        self.peak_buffers = 0
        self.buckets: list[Bucket] = []
        self.order: dict[str, list[Bucket]] = {}  # launch order per group
        self.next: dict[str, int] = {}
        self.build_buckets(self.bucket_params())
        self.build_state()
        self.where: dict[int, tuple[Bucket, int]] = {}
        for b in self.buckets:
            for j, p in enumerate(b.params):
                self.where[id(p)] = (b, j)
                p.register_post_accumulate_grad_hook(self.grad_ready)
        self.opt = FlatAdamW([b.master for b in self.buckets], train.beta1, train.beta2,
                             train.eps, train.weight_decay)
        self.zero_grad()

    # ------------------------------------------------------------------ layout
    def bucket_params(self) -> list[list[nn.Parameter]]:
        """Lists of parameters, in the order their gradients are (roughly) produced; each list
        is split by reduction group and, for DDP/ZeRO-1/2, by the bucket size."""
        return [list(reversed(self.params))]

    def split_by_size(self) -> bool:
        return True

    def build_buckets(self, units: list[list[nn.Parameter]]) -> None:
        esize = torch.empty((), dtype=self.grad_dtype).element_size()
        cap = max(1, int(self.par.bucket_mb * 2**20 / esize))
        for unit in units:
            by_group: dict[str, list[nn.Parameter]] = {}
            for p in unit:
                by_group.setdefault(grad_group_name(p), []).append(p)
            for name, ps in by_group.items():
                group = self.grid[name]
                shards = group.size if self.zero else 1
                pieces = split_buckets(ps, cap) if self.split_by_size() else [ps]
                for piece in pieces:
                    b = Bucket(piece, name, group, shards, len(self.buckets))
                    self.buckets.append(b)
                    self.order.setdefault(name, []).append(b)

    def build_state(self) -> None:
        """Flat parameters (``p.data`` become views), masters and gradient buffers."""
        for b in self.buckets:
            flat = torch.zeros(b.padded, dtype=self.compute_dtype)
            with torch.no_grad():
                for j, p in enumerate(b.params):
                    flat[b.offsets[j]:b.offsets[j] + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = b.view(flat, j)
            b.param_full = flat
            b.param_shard = self.own_shard(flat, b)
            b.master = b.param_shard.float().clone() if self.separate_master else b.param_shard
            if self.persistent_full_grads():
                b.grad = torch.zeros(b.padded, dtype=self.grad_dtype)
                b.grad_shard = b.grad[b.lo:b.hi]
            else:
                b.grad_shard = torch.zeros(b.shard_numel, dtype=self.grad_dtype)

    def own_shard(self, flat: torch.Tensor, b: Any) -> torch.Tensor:
        """This rank's slice of a bucket's flat parameters: a view (the full buffer stays)."""
        return flat[b.lo:b.hi]

    def attach_grads(self) -> bool:
        """Whether ``p.grad`` are views of a persistent full gradient buffer (autograd then
        accumulates in place); otherwise the hook copies each gradient in and drops it."""
        return self.grad_dtype == self.compute_dtype and self.zero <= 1

    def persistent_full_grads(self) -> bool:
        return self.zero <= 1

    # ------------------------------------------------------------------ buffers
    def hold(self, n: int) -> None:
        self.live_buffers += n
        self.peak_buffers = max(self.peak_buffers, self.live_buffers)

    def release(self, n: int) -> None:
        self.live_buffers -= n

    def ensure_grad(self, b: Bucket) -> torch.Tensor:
        if b.grad is None:
            b.grad = torch.zeros(b.padded, dtype=self.grad_dtype)
            self.hold(nbytes(b.grad))
        return b.grad

    # ------------------------------------------------------------------ step pieces
    def zero_grad(self) -> None:
        for b in self.buckets:
            b.ready, b.launched, b.handle = 0, False, None
            if self.persistent_full_grads():
                if b.grad is None:
                    b.grad = torch.zeros(b.padded, dtype=self.grad_dtype)
                    b.grad_shard = b.grad[b.lo:b.hi]
                b.grad.zero_()
                if self.attach_grads():
                    for j, p in enumerate(b.params):
                        p.grad = b.view(b.grad, j)
                else:
                    for p in b.params:
                        p.grad = None
            else:
                for p in b.params:
                    p.grad = None
        self.next = {name: 0 for name in self.order}
        self.overflow = False
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
                self.ensure_grad(b)
                b.view(b.grad, j).add_(g.detach())
                p.grad = None
        self.after_grad(b, j)
        if not self.last_micro or not self.overlap:
            return
        for name in getattr(p, "_fived_grad_reduce", ()):
            ops.all_reduce(b.view(self.ensure_grad(b), j), self.grid[name])
        b.ready += 1
        if b.ready == len(b.params):
            self.launch_ready(b.group_name)

    def after_grad(self, b: Bucket, j: int) -> None:
        """Hook for ZeRO-3 (free a unit's gathered parameters once its backward is done)."""

    def launch_ready(self, name: str) -> None:
        seq = self.order[name]
        while self.next[name] < len(seq) and seq[self.next[name]].ready == len(
                seq[self.next[name]].params):
            self.launch(seq[self.next[name]])
            self.next[name] += 1
            if not self.persistent_full_grads() and self.next[name] > 2:
                self.drain(seq[self.next[name] - 3])

    def drain(self, b: Bucket) -> None:
        """ZeRO-2/3: wait for an older bucket's reduce-scatter so that at most two transient
        gradient buffers per group are in flight."""
        if b.handle is not None:
            b.handle.wait()
            b.handle = None
            self.after_reduce(b)

    def launch(self, b: Bucket) -> None:
        grad = self.ensure_grad(b)
        if self.zero == 0:
            b.handle = ops.all_reduce(grad, b.group, async_op=True)
        else:  # in place: this member's reduced shard lands in its own slice of the buffer
            b.handle = ops.reduce_scatter(grad, b.group, async_op=True, out=grad[b.lo:b.hi])
        b.launched = True

    def reduce_replicated(self) -> None:
        """Sum gradients of parameters replicated inside a model-parallel group (attribute
        ``_fived_grad_reduce``: group names), e.g. norm weights under sequence parallelism."""
        for b in self.buckets:
            for j, p in enumerate(b.params):
                for name in getattr(p, "_fived_grad_reduce", ()):
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
            if b.handle is not None:
                b.handle.wait()
                b.handle = None
            self.after_reduce(b)
        self.after_finish()

    def after_reduce(self, b: Bucket) -> None:
        """ZeRO-2/3: keep the owned shard of the reduced gradient, drop the full buffer."""
        if not self.persistent_full_grads() and b.grad is not None:
            b.grad_shard.copy_(b.grad[b.lo:b.hi])
            self.release(nbytes(b.grad))
            b.grad = None

    def after_finish(self) -> None:
        pass

    def full_grads(self) -> dict[str, torch.Tensor]:
        """After ``finish``: each parameter's reduced gradient (this rank's tp/ep piece), the
        ZeRO shards gathered over their group (counted as ``metrics``)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = {}
        for b in self.buckets:
            full = b.grad_shard
            if b.shards > 1:
                full = torch.zeros(b.padded, dtype=b.grad_shard.dtype)
                ops.all_gather_into(full, b.grad_shard, replace(b.group, name="metrics"))
            for j, p in enumerate(b.params):
                out[names[id(p)]] = b.view(full, j).clone()
        return out

    # ------------------------------------------------------------------ norm, clip, step
    def owned_grads(self) -> list[torch.Tensor]:
        return [b.grad_shard for b in self.buckets]

    def grad_sq(self) -> torch.Tensor:
        """Σ g² over the whole model, each element counted once (see ``clip``)."""
        tp = self.grid.degrees["tp"]
        sums = {"dense": torch.zeros((), dtype=torch.float64),
                "expert": torch.zeros((), dtype=torch.float64)}
        for b in self.buckets:
            g = b.grad_shard
            for lo, hi, w in b.segments:
                sums[b.group_name] += g[lo:hi].double().pow(2).sum() * (w / tp)
        if self.zero:  # shards: add up the owners of one replica's elements
            for name in sums:
                ops.all_reduce(sums[name], replace(self.grid[name], name="metrics"))
        return self.combine_sq(sums["dense"], sums["expert"])

    def combine_sq(self, dense: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        metrics = {n: replace(self.grid[n], name="metrics") for n in ("ep", "tp", "pp")}
        ops.all_reduce(expert, metrics["ep"])
        total = dense + expert
        ops.all_reduce(total, metrics["tp"])
        ops.all_reduce(total, metrics["pp"])
        return total

    def scale_grads(self, factor: float) -> None:
        for g in self.owned_grads():
            g.mul_(factor)

    def clip(self, max_norm: float) -> float:
        if self.scaler is not None:
            self.scale_grads(1.0 / self.scaler.scale)
        norm = float(self.grad_sq().sqrt())
        if not math.isfinite(norm):
            self.overflow = True
            return norm
        if max_norm > 0 and norm > max_norm:
            self.scale_grads(max_norm / (norm + 1e-6))
        return norm

    def step(self, lr: float) -> bool:
        """AdamW on the owned fp32 masters; False (and no update) when fp16 overflowed."""
        if self.scaler is not None:
            skipped = self.overflow
            old = self.scaler.scale
            self.scaler.update(skipped)
            if skipped:
                if is_rank0():
                    print(f"fp16: gradient overflow at loss scale {old:g}; step skipped, "
                          f"scale -> {self.scaler.scale:g}", flush=True)
                return False
        elif self.overflow:
            return False
        with torch.no_grad():
            self.opt.step(self.owned_grads(), lr)
            self.publish_params()
        return True

    def publish_params(self) -> None:
        """Write the updated masters back into the compute-dtype parameters."""
        if self.separate_master:
            for b in self.buckets:
                b.param_shard.copy_(b.master)
        if self.zero in (1, 2):
            handles = [ops.all_gather_into(b.param_full, b.param_shard, b.group, async_op=True)
                       for b in self.buckets]
            for h in handles:
                h.wait()

    # ------------------------------------------------------------------ accounting
    def padding_bytes(self) -> float:
        """Bytes of padding in the states this rank holds; a sharded state's padding is
        counted as its 1/N share, so that every rank's bytes = formula(Ψ) + padding exactly."""
        total = 0.0
        for b in self.buckets:
            if not b.pad:
                continue
            for t, full in self.state_tensors(b):
                per = t.element_size()
                total += b.pad * per if full else b.pad * per / b.shards
        return total

    def state_tensors(self, b: Bucket) -> list[tuple[torch.Tensor, bool]]:
        """(tensor, is-full-length) for every model-state tensor of bucket ``b``."""
        out = [(b.param_full, True) if self.zero < 3 else (b.param_shard, False)]
        if self.persistent_full_grads():
            out.append((b.grad, True))
        else:
            out.append((b.grad_shard, False))
        if self.separate_master:
            out.append((b.master, self.zero == 0))
        i = self.buckets.index(b)
        out += [(self.opt.m[i], self.zero == 0), (self.opt.v[i], self.zero == 0)]
        return out

    def memory(self) -> dict[str, Any]:
        """Bytes this rank holds, from the tensors themselves."""
        params = sum(nbytes(b.param_full if self.zero < 3 else b.param_shard)
                     for b in self.buckets)
        grads = sum(nbytes(b.grad if self.persistent_full_grads() else b.grad_shard)
                    for b in self.buckets)
        master = sum(nbytes(b.master) for b in self.buckets) if self.separate_master else 0
        return {
            "params": params,
            "grads": grads,
            "master": master,
            "optimizer": self.opt.state_bytes(),
            "buffers": self.peak_buffers,
            "padding": self.padding_bytes(),
        }


def make_engine(model: nn.Module, grid: Any, par: Any, train: Any) -> DataParallel:
    """The data-parallel engine for ``par``: DDP, ZeRO-1/2 or ZeRO-3, any precision."""
    if par.zero == 3:
        from .zero import Zero3

        return Zero3(model, grid, par, train)
    if par.zero:
        from .zero import ZeroEngine

        return ZeroEngine(model, grid, par, train)
    if par.precision != "fp32":
        from .precision import MixedPrecisionDataParallel

        return MixedPrecisionDataParallel(model, grid, par, train)
    return DataParallel(model, grid, par, train)
