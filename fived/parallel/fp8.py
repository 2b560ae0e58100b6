"""fp8 linear layers on a laid-out model: ``apply_fp8(model, group, recipe)``.

Applied after the cuts (tensor, context, expert parallelism) and before recompute, by module
name, as the other dimensions are (``FP8_LINEARS``): every linear layer of attention, the MLP,
the routed and shared experts runs its three products in fp8 (``fived.model.fp8``); the
embedding, the head, the router and the shared-expert gate, and the norms keep the compute
dtype (``fived.model.fp8``'s docstring says why). The parameters are the same objects under the
same names: placements, engines, checkpoints and the optimizer see no difference (master
weights and optimizer states stay as ``--precision`` and ``--master-weights`` keep them).

A plain ``nn.Linear`` becomes ``Fp8Linear``. A tensor-parallel layer keeps its class and gets
its product function (``linear``) replaced: a column layer's output features (N) and a row
layer's input features (K) are cut across tp, so every amax taken over a whole cut dimension
(tensorwise: every operand that has one; rowwise: the scales along it) is max-reduced over tp
(``Cut``): each rank casts with the scale the one-rank model uses, and the tp model equals the
one-rank fp8 model. The reduction costs, per fp8 linear and micro-batch, one all-reduce of one
float per amax (tensorwise: 2 in forward, 2–4 in backward) or of one float per row or column
(rowwise) on tp. Blockwise tiles stop at a cut when the cut falls on a tile edge
(``fived.config``'s validation asks for shard widths that are multiples of 128).

Context parallelism cuts the tokens (M): a scale that spans the tokens is max-reduced over cp
too — tensorwise: x (forward, one cast shared by q/k/v and by gate/up) and dy (dgrad, wgrad);
rowwise: the weight gradient's scales, one per output feature of dyᵀ and per input feature of
x (along the tokens); blockwise: none, its 1×128 and 128×1 token tiles stop at the zigzag chunk
edges (``fived.config`` asks for chunks of whole 128-tiles). So every cp rank casts as the
one-rank micro-batch does. A routed expert sees the tokens its router sent it on this rank
(possibly none: no collective can be posted), so its casts stay the rank's own, as under ep.

Experts run as a loop of fp8 linears (one per expert) under fp8: the grouped kernel
(``fived.model.grouped``) has no fp8 form here.

An fp8 column layer reads its input through plain autograd: ``copy_to`` (its dX all-reduced in
backward), or under sequence parallelism ``gather_from`` (all-gather forward, reduce-scatter
backward), and the fp8 function saves the gathered input in fp8. The bf16 path instead saves
the shard and gathers it again in backward, and with ``--overlap`` hides dX's reduction behind
the weight gradient (``tensor._ColumnMatmul``); the fp8 columns do neither.
"""

from __future__ import annotations

import re
from dataclasses import replace
from functools import partial
from typing import Any

from torch import nn

from ..comm import ops
from ..ledger.params import FP8_LINEARS
from ..model.fp8 import Cut, Fp8Linear, fp8_linear
from ..model.moe import MoE
from .tensor import ColumnLinear, RowLinear

ROUTED = re.compile(r"\.experts\.\d+\.w[123]$")  # a routed expert: its tokens are its own


def _max_over(group: Any, amax) -> None:
    ops.all_reduce(amax, group, op="max")


def apply_fp8(model: nn.Module, group: Any, recipe: str, cp_group: Any = None) -> nn.Module:
    """Swap ``model``'s linear layers named by ``FP8_LINEARS`` to fp8 products under
    ``recipe``; ``group`` is the tp group their cuts span, ``cp_group`` the cp group that cuts
    their tokens (``ROUTED``'s excepted). ``recipe`` "none" leaves it as is."""
    if recipe == "none":
        return model
    cut = (Cut("N", partial(_max_over, group)), Cut("K", partial(_max_over, group)))
    tokens = (Cut("M", partial(_max_over, cp_group)),) if cp_group and cp_group.size > 1 else ()
    swaps = []
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            module.cfg = replace(module.cfg, expert_matmul="loop")
        if not FP8_LINEARS.search(name):
            continue
        m_cut = () if ROUTED.search(name) else tokens
        if isinstance(module, ColumnLinear):
            module.linear = partial(fp8_linear, recipe=recipe,
                                    cuts=((cut[0],) if group.size > 1 else ()) + m_cut)
        elif isinstance(module, RowLinear):
            module.linear = partial(fp8_linear, recipe=recipe,
                                    cuts=((cut[1],) if group.size > 1 else ()) + m_cut)
        elif type(module) is nn.Linear:
            swaps.append((name, Fp8Linear(module, recipe, m_cut)))
    for name, new in swaps:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return model
