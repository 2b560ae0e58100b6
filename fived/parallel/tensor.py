"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti
et al. 2022): each weight matrix is cut across the ``tp`` group.

Column-parallel ``Y_i = X W_iᵀ`` (W cut on its output features) needs the full input X on every
rank: forward identity, backward all-reduce of dX (``copy_to``). Row-parallel ``Y = Σ_i X_i W_iᵀ``
(W cut on its input features) sums partial outputs: forward all-reduce, backward identity
(``reduce_from``). Attention cuts heads (wq/wk/wv column, wo row), the MLP cuts ffn (gate/up
column, down row), so one block costs per micro-batch, with ``A = b·s·h`` activation bytes:

    forward  2 all-reduces of A      backward 2 all-reduces of A
    bytes sent per rank per block = 4 · 2(tp−1)/tp · A

With sequence parallelism the residual stream and RMSNorm run on a 1/tp slice of the sequence;
each all-reduce becomes an all-gather (before the column layers) and a reduce-scatter (after the
row layers) — the same bytes, and 1/tp of the norm/residual activations.

Grouped-query attention: kv heads are cut when tp divides them; when tp > kv_heads each kv
chunk is held by tp/kv_heads ranks, and each replica sees only the gradient of its own query
heads, so the replicas' weight gradients are summed in backward — through the tp group itself:
each rank writes its chunk's gradient into a zero (kv_heads·d, h) buffer, one all-reduce sums
it, each rank keeps its chunk (no extra process groups).

The vocab-parallel embedding masks tokens outside its vocab slice and reduces the partial
embeddings (all-reduce; reduce-scatter to the sequence shard with SP). The vocab-parallel
cross-entropy never gathers the logits: per token it all-reduces the max (b·s floats), then the
sum of exponentials and the target logit together (2·b·s floats); backward is local,
``softmax − onehot``. Every tp rank holds the same full loss.

``tp_traffic_bytes`` below is the formula for every byte the tp group sends in one step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import autograd as R
from ..comm import ops
from ..model.init import full_param, shard


def _sp(plan: Any) -> bool:
    return bool(plan.par.sequence_parallel)


def enter_columns(plan: Any, x: torch.Tensor) -> torch.Tensor:
    """The input of a column-parallel layer: the full activation, with its conjugate backward.

    Several column layers read the same tensor (wq, wk, wv; w_gate, w_up); they share one
    region, so dX is all-reduced (or reduce-scattered) once, not once per layer.
    """
    cache = getattr(plan, "_tp_column_input", None)
    if cache is not None and cache[0] is x:
        return cache[1]
    group = plan.group("tp")
    if _sp(plan):  # one contiguous copy, not one per consumer's matmul
        y = R.gather_from(x, group, dim=1).contiguous()
    else:
        y = R.copy_to(x, group)
    plan._tp_column_input = (x, y)
    return y


class _Region:
    """One column region with overlap: the full input, and the dX of its consumers summed."""

    def __init__(self, plan: Any, x: torch.Tensor):
        self.group, self.sp = plan.group("tp"), _sp(plan)
        self.pending, self.acc = 0, None
        with torch.no_grad():
            self.full = (ops.all_gather(x, self.group, dim=1).contiguous() if self.sp
                         else x.detach())


class _ColumnMatmul(torch.autograd.Function):
    """y = x_full Wᵀ inside a shared region. Backward: dX of every consumer is summed; the last
    consumer to run starts the all-reduce (SP: reduce-scatter) of the sum asynchronously, then
    computes its own weight gradient while the collective is in flight (Megatron's overlap)."""

    @staticmethod
    def forward(ctx, x, w, region):
        region.pending += 1
        ctx.region = region
        ctx.save_for_backward(region.full, w)
        return F.linear(region.full, w)

    @staticmethod
    def backward(ctx, g):
        full, w = ctx.saved_tensors
        r = ctx.region
        dx = g.matmul(w)
        r.acc = dx if r.acc is None else r.acc.add_(dx)
        r.pending -= 1
        handle = None
        if r.pending == 0:
            acc, r.acc = r.acc, None
            handle = (ops.reduce_scatter(acc, r.group, dim=1, async_op=True) if r.sp
                      else ops.all_reduce(acc, r.group, async_op=True))
        dw = g.flatten(0, -2).t().matmul(full.flatten(0, -2))
        return (handle.wait() if handle is not None else None), dw, None


def column_matmul(plan: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x Wᵀ for a column-cut W, x the (shard of the) input; overlapped when ``par.overlap``."""
    if not getattr(plan.par, "overlap", False):
        return F.linear(enter_columns(plan, x), w)
    cache = getattr(plan, "_tp_region", None)
    if cache is None or cache[0] is not x:
        cache = (x, _Region(plan, x))
        plan._tp_region = cache
    return _ColumnMatmul.apply(x, w, cache[1])


def exit_rows(plan: Any, y: torch.Tensor) -> torch.Tensor:
    """The output of a row-parallel layer: partial sums reduced (to the sequence shard with SP)."""
    group = plan.group("tp")
    return R.scatter_to(y, group, dim=1) if _sp(plan) else R.reduce_from(y, group)


class _ReplicaGradSum(torch.autograd.Function):
    """Identity forward; backward sums the weight gradient over the ranks holding the same chunk
    (chunk ``index`` of ``shards``), via one zero-padded all-reduce over the tp group."""

    @staticmethod
    def forward(ctx, w, group, shards, index):
        ctx.group, ctx.shards, ctx.index = group, shards, index
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        buf = torch.zeros((ctx.shards,) + tuple(g.shape), dtype=g.dtype, device=g.device)
        buf[ctx.index].copy_(g)
        ops.all_reduce(buf, ctx.group)
        return buf[ctx.index].clone(), None, None, None


def tp_weight(plan: Any, name: str, shape: tuple[int, int], std: float, dim: int,
              shards: int | None = None, index: int | None = None) -> nn.Parameter:
    """Piece ``index`` of ``shards`` (default: this tp rank of tp) of the full weight drawn from
    (seed, name), cut along ``dim``; tagged with its shard count."""
    shards = plan.tp if shards is None else shards
    index = plan.tp_rank if index is None else index
    w = nn.Parameter(shard(full_param(plan.seed, name + ".weight", shape, std), dim, shards,
                           index).to(plan.dtype))
    w._fived_tp_shards = shards
    return w


class ColumnLinear(nn.Module):
    """y_i = x W_iᵀ with W's output features cut in ``shards`` chunks (tp, or kv_heads when the
    kv heads are replicated); the output stays cut (b, s, out/shards)."""

    def __init__(self, plan: Any, name: str, in_f: int, out_f: int, std: float, shards: int):
        super().__init__()
        tp = plan.tp
        if shards > tp or tp % shards:
            raise ValueError(f"{name}: {shards} shards over tp={tp}")
        self.plan, self.shards = plan, shards
        self.index = plan.tp_rank * shards // tp
        self.weight = tp_weight(plan, name, (out_f, in_f), std, 0, shards, self.index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.shards < self.plan.tp:
            w = _ReplicaGradSum.apply(w, self.plan.group("tp"), self.shards, self.index)
        return column_matmul(self.plan, x, w)


class RowLinear(nn.Module):
    """y = Σ_i x_i W_iᵀ with W's input features cut across tp; the partial sums are reduced."""

    def __init__(self, plan: Any, name: str, in_f: int, out_f: int, std: float):
        super().__init__()
        self.plan = plan
        self.weight = tp_weight(plan, name, (out_f, in_f), std, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exit_rows(self.plan, F.linear(x, self.weight))


class VocabEmbedding(nn.Module):
    """Rows [r·V/tp, (r+1)·V/tp) of the embedding; tokens outside give zeros; reduced across tp."""

    def __init__(self, plan: Any, name: str, vocab: int, hidden: int, std: float):
        super().__init__()
        self.plan = plan
        self.per_rank = vocab // plan.tp
        self.start = plan.tp_rank * self.per_rank
        self.weight = tp_weight(plan, name, (vocab, hidden), std, 0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.per_rank)
        e = F.embedding(local.masked_fill(outside, 0), self.weight)
        e = e.masked_fill(outside.unsqueeze(-1), 0.0)
        return exit_rows(self.plan, e)


class VocabHead(nn.Module):
    """The output projection hidden -> vocab, vocab cut across tp: local logits (b, s, V/tp)."""

    def __init__(self, plan: Any, name: str, hidden: int, vocab: int, std: float):
        super().__init__()
        self.plan = plan
        self.weight = tp_weight(plan, name, (vocab, hidden), std, 0)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return vocab_logits(self.plan, h, self.weight)


def vocab_logits(plan: Any, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Local logits h Wᵀ for this rank's vocab slice (the tied head reuses the embedding's)."""
    return column_matmul(plan, h, weight)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, start):
        z = logits.float()
        v = z.shape[-1]
        m = z.max(dim=-1).values
        ops.all_reduce(m, group, op="max")
        z = z - m.unsqueeze(-1)
        ez = z.exp()
        local = targets - start
        inside = (local >= 0) & (local < v)
        idx = local.clamp(0, v - 1)
        target_z = z.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * inside
        both = torch.stack([ez.sum(-1), target_z])
        ops.all_reduce(both, group)
        sumexp, target_z = both[0], both[1]
        ez.div_(sumexp.unsqueeze(-1))  # softmax of the local slice
        ctx.save_for_backward(ez, idx, inside)
        ctx.in_dtype = logits.dtype
        return (sumexp.log() - target_z).sum()

    @staticmethod
    def backward(ctx, g):
        p, idx, inside = ctx.saved_tensors
        grad = p.clone()
        grad.scatter_add_(-1, idx.unsqueeze(-1), -inside.to(grad.dtype).unsqueeze(-1))
        return (grad * g).to(ctx.in_dtype), None, None, None


def vocab_parallel_loss(logits: torch.Tensor, targets: torch.Tensor, group: Any) -> torch.Tensor:
    """Σ over tokens of CE, from vocab-cut logits (b, s, V/tp); the same full sum on every rank."""
    start = group.rank * logits.shape[-1]
    return _VocabParallelCE.apply(logits, targets, group, start)


def mark_norm(plan: Any, norm: nn.Module) -> nn.Module:
    """Under SP a norm sees only its sequence shard: its weight's gradient is partial over tp."""
    if plan.tp > 1 and _sp(plan):
        norm.weight._fived_grad_reduce = ("tp",)
    return norm


# ---------------------------------------------------------------------------- the formula


def tp_traffic_bytes(model: Any, par: Any, micro_batch: int, pp_rank: int = 0
                     ) -> dict[str, float]:
    """Bytes one rank sends over the tp group in one optimizer step, by collective.

    ``micro_batch`` sequences per micro-batch (par.micro_batches of them), ``s`` = seq_len / cp,
    ``A = micro_batch·s·h·dtype_bytes``. Per micro-batch:

    * each block: 2 forward + 2 backward all-reduces of A (SP: 2 all-gathers + 2 reduce-scatters
      of A each way); full recompute reruns the forward up to its last saved tensor: +1
      all-reduce (SP: +2 all-gathers, +1 reduce-scatter);
    * replicated kv heads (tp > kv_heads): per block 2 all-reduces of the full (kv_heads·d, h)
      weight gradient (wk, wv);
    * embedding: 1 forward all-reduce of A (SP: reduce-scatter forward, all-gather backward);
    * head (or tied head): 1 backward all-reduce of A (SP: all-gather forward, reduce-scatter
      backward);
    * loss: all-reduce of micro_batch·s fp32 maxima and of 2·micro_batch·s fp32 (sum-exp, target).

    Per step: with SP, one all-reduce of each norm weight's gradient (2 per block + final norm).
    A MoE block without a shared expert has only the attention's cut (its routed experts are
    whole on every tp rank). The ledger (``fived.ledger.traffic.tp_traffic``) holds the formula;
    this sums its collectives by op for the rank at pipeline coordinate ``pp_rank``.
    """
    from ..ledger.traffic import tp_traffic

    out: dict[str, float] = {}
    for c in tp_traffic(model, par, micro_batch, pp_rank):
        out[c.op] = out.get(c.op, 0.0) + c.bytes
    return {k: v for k, v in out.items() if v}
