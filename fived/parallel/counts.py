"""A MoE layer's routed counts summed over the groups that cut its sequences.

The balance loss of a MoE layer needs, per sequence, how many of its tokens each expert was
routed (``MoE.reduce_counts``, None: every token of the sequence is on this rank). A dimension
that cuts sequences hands the layer a reduction over its group: context parallelism (``cp``:
each rank holds a slice of every sequence) and tensor parallelism with sequence parallelism
(``tp``: each rank routes its own sequence shard). With both, the layer sums over tp then cp
(the order ``parallelize`` applies them), one all-reduce of the (b, E) counts each.

Neutral ground: tensor (``tensor.py``), context (``context.py``) and expert parallelism
(``expert.py``) each may use it without importing one another.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..comm import ops


class CountReduction:
    """Sums a MoE layer's per-sequence routed counts over the groups that cut its sequences."""

    def __init__(self, groups: list[Any]):
        self.groups = groups

    def __call__(self, routed: torch.Tensor) -> torch.Tensor:
        for g in self.groups:
            ops.all_reduce(routed, g)
        return routed


def add_count_reduction(moe: nn.Module, group: Any) -> None:
    """``moe``'s sequences are (also) cut over ``group`` (cp, or tp under sequence parallelism)."""
    before = moe.reduce_counts.groups if isinstance(moe.reduce_counts, CountReduction) else []
    moe.reduce_counts = CountReduction(before + [group])
