"""Data parallelism: gradients summed over the ranks that hold the same parameters.

Every rank computes the gradient of Σ_local-tokens CE / global_tokens, so the *sum* over the
data-parallel group is exactly the one-rank gradient (no averaging, any number of micro-batches).

Dense parameters are reduced over the ``dense`` group (dp·ep·cp); expert parameters (attribute
``_fived_expert``) over the ``expert`` group (dp·cp). Gradients live in one flat fp32 buffer
per group (``param.grad`` are views into it), reduced with a ring all-reduce:

    bytes sent per rank per step = 2·(N−1)/N · gradient bytes            (N = group size)

Model states, fp32 training: params 4Ψ + grads 4Ψ + Adam m, v 8Ψ = 16Ψ bytes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..comm import ops
from .adam import FlatAdamW


def grad_group_name(p: nn.Parameter) -> str:
    return "expert" if getattr(p, "_fived_expert", False) else "dense"


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class GradBuffer:
    """One flat gradient buffer for the parameters reduced over one group."""

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype):
        self.params = params
        total = sum(p.numel() for p in params)
        self.flat = torch.zeros(total, dtype=dtype)
        self.views: list[torch.Tensor] = []
        off = 0
        for p in params:
            v = self.flat[off:off + p.numel()].view_as(p)
            self.views.append(v)
            off += p.numel()

    def attach(self) -> None:
        for p, v in zip(self.params, self.views):
            p.grad = v


class DataParallel:
    """The plain (ZeRO-0) engine: replicated params, flat grads, all-reduce, AdamW."""

    zero = 0

    def __init__(self, model: nn.Module, grid: Any, par: Any, train: Any):
        self.model, self.grid, self.par, self.train = model, grid, par, train
        params = [p for p in model.parameters() if p.requires_grad]
        self.groups: dict[str, list[nn.Parameter]] = {}
        for p in params:
            self.groups.setdefault(grad_group_name(p), []).append(p)
        self.buffers = {g: GradBuffer(ps, torch.float32) for g, ps in self.groups.items()}
        for b in self.buffers.values():
            b.attach()
        self.opt = FlatAdamW(params, train.beta1, train.beta2, train.eps, train.weight_decay)
        self.params = params

    # ------------------------------------------------------------------ step pieces
    def zero_grad(self) -> None:
        for b in self.buffers.values():
            b.flat.zero_()
            b.attach()

    def set_last_micro(self, last: bool) -> None:
        """Called before each micro-batch's backward; reduction happens after the last one."""
        self.last_micro = last

    def reduce_replicated(self) -> None:
        """Sum gradients of parameters replicated inside a model-parallel group (attribute
        ``_fived_grad_reduce``: group names), e.g. norm weights under sequence parallelism."""
        for p in self.params:
            for name in getattr(p, "_fived_grad_reduce", ()):
                ops.all_reduce(p.grad, self.grid[name])

    def finish(self) -> None:
        """Reduce gradients across the data-parallel groups."""
        self.reduce_replicated()
        for name, buf in self.buffers.items():
            ops.all_reduce(buf.flat, self.grid[name])

    def grad_sq(self) -> torch.Tensor:
        """Σ g² over the whole model, each element counted once (see ``clip``)."""
        tp = self.grid.degrees["tp"]
        dense = torch.zeros((), dtype=torch.float64)
        expert = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            sq = p.grad.double().pow(2).sum() * getattr(p, "_fived_tp_shards", 1) / tp
            if grad_group_name(p) == "expert":
                expert += sq
            else:
                dense += sq
        return self.combine_sq(dense, expert)

    def combine_sq(self, dense: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        metrics = {n: replace(self.grid[n], name="metrics") for n in ("ep", "tp", "pp")}
        ops.all_reduce(expert, metrics["ep"])
        total = dense + expert
        ops.all_reduce(total, metrics["tp"])
        ops.all_reduce(total, metrics["pp"])
        return total

    def clip(self, max_norm: float) -> float:
        norm = float(self.grad_sq().sqrt())
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for b in self.buffers.values():
                b.flat.mul_(scale)
        return norm

    def step(self, lr: float) -> bool:
        with torch.no_grad():
            self.opt.step([p.grad for p in self.params], lr)
        return True

    # ------------------------------------------------------------------ accounting
    def memory(self) -> dict[str, int]:
        """Bytes this rank holds, from the tensors themselves."""
        return {
            "params": sum(nbytes(p) for p in self.params),
            "grads": sum(nbytes(b.flat) for b in self.buffers.values()),
            "master": 0,  # fp32 training: the parameters are the master weights
            "optimizer": self.opt.state_bytes(),
            "buffers": 0,
            "padding": 0,
        }


def make_engine(model: nn.Module, grid: Any, par: Any, train: Any) -> DataParallel:
    if par.zero:
        from .zero import ZeroEngine

        return ZeroEngine(model, grid, par, train)
    if par.precision != "fp32":
        from .precision import MixedPrecisionDataParallel

        return MixedPrecisionDataParallel(model, grid, par, train)
    return DataParallel(model, grid, par, train)
