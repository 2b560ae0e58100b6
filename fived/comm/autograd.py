"""Differentiable communication regions — each forward collective has its conjugate backward.

=================  =======================  ============================  ====================
function           forward                  backward                      used by
=================  =======================  ============================  ====================
``copy_to``        identity                 all-reduce                    TP column input
``reduce_from``    all-reduce               identity                      TP row output
``gather_from``    all-gather along dim     reduce-scatter along dim      SP before column
``scatter_to``     reduce-scatter along dim all-gather along dim          SP after row
``split_to``       keep own chunk along dim all-gather along dim          enter a sharded region
``gather_to``      all-gather along dim     keep own chunk along dim      leave a sharded region
``all_to_all``     all-to-all               all-to-all with splits swapped EP dispatch, Ulysses
=================  =======================  ============================  ====================

All collectives go through ``fived.comm.ops`` so their bytes are counted (backward ones too).
"""

from __future__ import annotations

from typing import Any

import torch

from . import ops


def _chunk(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return ops.all_reduce(g.contiguous().clone(), ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return ops.all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return ops.all_gather(x, group, dim=dim)

    @staticmethod
    def backward(ctx, g):
        return ops.reduce_scatter(g, ctx.group, dim=ctx.dim), None, None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return ops.reduce_scatter(x, group, dim=dim)

    @staticmethod
    def backward(ctx, g):
        return ops.all_gather(g, ctx.group, dim=ctx.dim), None, None


class _SplitTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _chunk(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return ops.all_gather(g, ctx.group, dim=ctx.dim), None, None


class _GatherTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return ops.all_gather(x, group, dim=dim)

    @staticmethod
    def backward(ctx, g):
        return _chunk(g, ctx.group, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, in_splits, out_splits):
        ctx.group, ctx.in_splits, ctx.out_splits = group, in_splits, out_splits
        return ops.all_to_all(x, group, in_splits, out_splits)

    @staticmethod
    def backward(ctx, g):
        return ops.all_to_all(g, ctx.group, ctx.out_splits, ctx.in_splits), None, None, None


def _trivial(group: Any) -> bool:
    return group is None or group.size == 1


def copy_to(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if _trivial(group) else _CopyTo.apply(x, group)


def reduce_from(x: torch.Tensor, group: Any) -> torch.Tensor:
    return x if _trivial(group) else _ReduceFrom.apply(x, group)


def gather_from(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    return x if _trivial(group) else _GatherFrom.apply(x, group, dim)


def scatter_to(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    return x if _trivial(group) else _ScatterTo.apply(x, group, dim)


def split_to(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    return x if _trivial(group) else _SplitTo.apply(x, group, dim)


def gather_to(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    return x if _trivial(group) else _GatherTo.apply(x, group, dim)


def all_to_all(
    x: torch.Tensor, group: Any, in_splits: list[int] | None = None,
    out_splits: list[int] | None = None,
) -> torch.Tensor:
    return x if _trivial(group) else _AllToAll.apply(x, group, in_splits, out_splits)
