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
row layers) — the same bytes, and 1/tp of the norm/residual activations. The column layers save
their input's shard, not the gathered sequence, and all-gather it again in backward for the
weight gradients (overlapped with the input-gradient matmul), as Megatron-Core does: one more
all-gather of A per column region (attention, MLP, head) per micro-batch.

Attention shapes (``ModelConfig``): q/k/v biases (``qkv_bias``) are cut with their column-cut
projections; the q/k norm gains (``qk_norm``) are whole on every rank, but each rank applies
them to its own heads, so their gradients are partial over tp and summed there (``grad_sum``),
with or without sequence parallelism (q and k cover the whole sequence after the column
matmul).

Grouped-query attention: kv heads are cut when tp divides them; when tp > kv_heads each kv
chunk is held by tp/kv_heads ranks, and each replica sees only the gradient of its own query
heads, so the replicas' weight gradients are summed in backward — through the tp group itself:
each rank writes its chunk's gradient into a zero (kv_heads·d, h) buffer, one all-reduce sums
it, each rank keeps its chunk (no extra process groups).

The vocab-parallel embedding masks tokens outside its vocab slice and reduces the partial
embeddings (all-reduce; reduce-scatter to the sequence shard with SP). The vocab-parallel
cross-entropy never gathers the logits: per token it all-reduces the max (b·s floats), then the
sum of exponentials and the target logit together (2·b·s floats); backward is local,
``softmax − onehot``, recomputed from the saved logits (compute dtype), max and sum. Every tp
rank holds the same full loss.

``apply_tp(model, group, placements, sequence_parallel, overlap)`` cuts a plain model: it
replaces each ``nn.Linear`` of attention and MLP with a ``ColumnLinear``/``RowLinear`` holding
its slice of the full weight, the embedding, head and loss with their vocab-parallel versions,
and records each cut in the parameters' ``Placement``. The column layers of one model share one
``Columns`` object: the layers that read the same input (q/k/v; gate/up) share its gathered copy
and the reduction of its gradient. ``tp_traffic_bytes`` below is the formula for every byte the
tp group sends in one step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import autograd as R
from ..comm import ops
from ..ledger.traffic import tp_traffic
from ..model import layers as L
from ..model.init import shard
from ..model.llama import Attention, Transformer
from ..model.moe import moe_layers
from .expert import add_count_reduction
from .placement import Placement


class _Region:
    """One column region: the inputs of the column layers that read one tensor (q/k/v; gate/up;
    the head), the full input while their forwards run, and the dX of their consumers summed.

    Forward all-gathers (SP) the sequence shard once for all consumers and drops the full copy
    when the next region opens; each consumer saves the *shard* (Megatron's
    ``LinearWithGradAccumulationAndAsyncCommunication``), and the first consumer to run
    backward all-gathers it again — asynchronously, while its input-gradient matmul runs — for
    every consumer's weight gradient; the last consumer frees it."""

    def __init__(self, group: Any, sp: bool, overlap: bool, x: torch.Tensor):
        self.group, self.sp, self.overlap = group, sp, overlap
        self.pending, self.acc, self.gathered = 0, None, None
        with torch.no_grad():
            self.full = (ops.all_gather(x, group, dim=1).contiguous() if sp else x.detach())

    def close(self) -> None:
        """The forward is done with the full input (the next region opened)."""
        self.full = None


class _ColumnMatmul(torch.autograd.Function):
    """y = x_full Wᵀ inside a shared region, saving x as given (the shard under SP). Backward:
    SP re-gathers x (once per region, overlapped with dX = g W); dX of every consumer is summed;
    the last consumer to run starts the all-reduce (SP: reduce-scatter) of the sum, with
    ``overlap`` asynchronously while it computes its own weight gradient (Megatron's overlap)."""

    @staticmethod
    def forward(ctx, x, w, region):
        region.pending += 1
        ctx.region = region
        ctx.save_for_backward(x, w)
        return F.linear(region.full, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        r = ctx.region
        r.full = None
        gather = None
        if r.sp and r.gathered is None:
            gather = ops.all_gather(x, r.group, dim=1, async_op=r.overlap)
        dx = g.matmul(w)
        if gather is not None:
            r.gathered = (gather.wait() if r.overlap else gather).contiguous()
        full = r.gathered if r.sp else x
        r.acc = dx if r.acc is None else r.acc.add_(dx)
        r.pending -= 1
        handle = None
        if r.pending == 0:
            acc, r.acc = r.acc, None
            handle = (ops.reduce_scatter(acc, r.group, dim=1, async_op=r.overlap) if r.sp
                      else ops.all_reduce(acc, r.group, async_op=r.overlap))
            if not r.overlap:
                handle = ops.Handle(None, None, "", handle)
        dw = g.flatten(0, -2).t().matmul(full.flatten(0, -2))
        if r.pending == 0:
            r.gathered = None
        return (handle.wait() if handle is not None else None), dw, None


class Columns:
    """The inputs of column-parallel layers: the full activation with its conjugate backward.

    Several column layers read the same tensor (q/k/v; gate/up; the head after the norm); they
    share one region keyed by the input tensor, so dX is all-reduced (or reduce-scattered) once,
    not once per layer, and under SP the shard is gathered once each way. With ``overlap`` the
    reduction runs while weight gradients compute, the backward re-gather while dX computes."""

    def __init__(self, group: Any, sequence_parallel: bool, overlap: bool):
        self.group, self.sp, self.overlap = group, sequence_parallel, overlap
        self._last: tuple[torch.Tensor, Any] | None = None

    def _region(self, x: torch.Tensor, make) -> Any:
        if self._last is None or self._last[0] is not x:
            if self._last is not None and isinstance(self._last[1], _Region):
                self._last[1].close()
            self._last = (x, make(x))
        return self._last[1]

    def matmul(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x Wᵀ for a column-cut W, x the (sequence shard of the) input."""
        if not self.overlap and not self.sp:
            return F.linear(self._region(x, lambda t: R.copy_to(t, self.group)), w)
        region = self._region(x, lambda t: _Region(self.group, self.sp, self.overlap, t))
        return _ColumnMatmul.apply(x, w, region)


def exit_rows(y: torch.Tensor, group: Any, sp: bool) -> torch.Tensor:
    """The output of a row-parallel layer: partial sums reduced (to the sequence shard with SP)."""
    return R.scatter_to(y, group, dim=1) if sp else R.reduce_from(y, group)


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


def _piece(weight: torch.Tensor, dim: int, parts: int, index: int) -> nn.Parameter:
    return nn.Parameter(shard(weight.detach(), dim, parts, index))


class ColumnLinear(nn.Module):
    """y_i = x W_iᵀ (+ b_i) with W's output features — and the bias, when there is one (q/k/v
    with ``qkv_bias``) — cut in ``shards`` chunks (tp, or kv_heads when the kv heads are
    replicated); the output stays cut (b, s, out/shards)."""

    def __init__(self, full: torch.Tensor, group: Any, columns: Columns, shards: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        tp = group.size
        if shards > tp or tp % shards:
            raise ValueError(f"{shards} shards over tp={tp}")
        self.group, self.columns, self.shards = group, columns, shards
        self.index = group.rank * shards // tp
        self.weight = _piece(full, 0, shards, self.index)
        self.bias = None if bias is None else _piece(bias, 0, shards, self.index)

    def _replica(self, w: torch.Tensor) -> torch.Tensor:
        """w, its gradient summed over the ranks holding the same chunk (replicated kv)."""
        if self.shards < self.group.size:
            return _ReplicaGradSum.apply(w, self.group, self.shards, self.index)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.columns.matmul(x, self._replica(self.weight))
        return y if self.bias is None else y + self._replica(self.bias)


class RowLinear(nn.Module):
    """y = Σ_i x_i W_iᵀ with W's input features cut across tp; the partial sums are reduced."""

    def __init__(self, full: torch.Tensor, group: Any, sequence_parallel: bool):
        super().__init__()
        self.group, self.sp = group, sequence_parallel
        self.weight = _piece(full, 1, group.size, group.rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exit_rows(F.linear(x, self.weight), self.group, self.sp)


class VocabEmbedding(nn.Module):
    """Rows [r·V/tp, (r+1)·V/tp) of the embedding; tokens outside give zeros; reduced across tp."""

    def __init__(self, full: torch.Tensor, group: Any, sequence_parallel: bool):
        super().__init__()
        self.group, self.sp = group, sequence_parallel
        self.per_rank = full.shape[0] // group.size
        self.start = group.rank * self.per_rank
        self.weight = _piece(full, 0, group.size, group.rank)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.per_rank)
        e = F.embedding(local.masked_fill(outside, 0), self.weight)
        e = e.masked_fill(outside.unsqueeze(-1), 0.0)
        return exit_rows(e, self.group, self.sp)


class VocabHead(nn.Module):
    """The output projection hidden -> vocab, vocab cut across tp: local logits (b, s, V/tp)."""

    def __init__(self, full: torch.Tensor, group: Any, columns: Columns):
        super().__init__()
        self.columns = columns
        self.weight = _piece(full, 0, group.size, group.rank)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.columns.matmul(h, self.weight)


class TiedVocabHead(nn.Module):
    """Tied head: local logits from the vocab-cut embedding's own (registered there) weight."""

    def __init__(self, embedding: VocabEmbedding, columns: Columns):
        super().__init__()
        object.__setattr__(self, "embedding", embedding)
        self.columns = columns

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.columns.matmul(h, self.embedding.weight)


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
        sumexp, target_z = both[0].clone(), both[1]  # sumexp alone is kept
        # one copy of the logits, in their own dtype, and two fp32 numbers per token: the
        # softmax of the local slice is recomputed in backward by the same ops (same bits)
        ctx.save_for_backward(logits, m, sumexp, idx, inside)
        return (sumexp.log() - target_z).sum()

    @staticmethod
    def backward(ctx, g):
        logits, m, sumexp, idx, inside = ctx.saved_tensors
        grad = (logits.float() - m.unsqueeze(-1)).exp()
        grad.div_(sumexp.unsqueeze(-1))  # softmax of the local slice
        grad.scatter_add_(-1, idx.unsqueeze(-1), -inside.to(grad.dtype).unsqueeze(-1))
        return (grad * g).to(logits.dtype), None, None, None


def vocab_parallel_loss(logits: torch.Tensor, targets: torch.Tensor, group: Any) -> torch.Tensor:
    """Σ over tokens of CE, from vocab-cut logits (b, s, V/tp); the same full sum on every rank."""
    start = group.rank * logits.shape[-1]
    return _VocabParallelCE.apply(logits, targets, group, start)


class VocabParallelLoss(nn.Module):
    def __init__(self, group: Any):
        super().__init__()
        self.group = group

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_loss(logits, targets, self.group)


# ---------------------------------------------------------------------------- applying it

def _cut(placements: dict[str, Placement], name: str, dim: int, parts: int, index: int) -> None:
    placements[name] = placements[name].cut(dim, parts, index)


def _columns(parent: nn.Module, prefix: str, attrs: tuple[str, ...], group: Any,
             columns: Columns, placements: dict[str, Placement], shards: int) -> None:
    for a in attrs:
        old = getattr(parent, a)
        lin = ColumnLinear(old.weight, group, columns, shards, old.bias)
        setattr(parent, a, lin)
        for kind in ("weight",) + (("bias",) if lin.bias is not None else ()):
            _cut(placements, f"{prefix}{a}.{kind}", 0, shards, lin.index)


def _row(parent: nn.Module, prefix: str, attr: str, group: Any, sp: bool,
         placements: dict[str, Placement]) -> None:
    setattr(parent, attr, RowLinear(getattr(parent, attr).weight, group, sp))
    _cut(placements, f"{prefix}{attr}.weight", 1, group.size, group.rank)


def _mlp(mlp: nn.Module, prefix: str, group: Any, columns: Columns, sp: bool,
         placements: dict[str, Placement]) -> None:
    _columns(mlp, prefix, ("gate_proj", "up_proj"), group, columns, placements, group.size)
    _row(mlp, prefix, "down_proj", group, sp, placements)


def _sum_over(placements: dict[str, Placement], module: nn.Module, prefix: str,
              group_name: str) -> None:
    """Gradients of ``module``'s (replicated) parameters are partial over ``group_name``."""
    for n, _ in module.named_parameters(prefix=prefix.rstrip(".")):
        placements[n] = replace(placements[n], grad_sum=placements[n].grad_sum + (group_name,))


def apply_tp(model: Transformer, group: Any, placements: dict[str, Placement],
             sequence_parallel: bool = False, overlap: bool = True) -> Transformer:
    """Cut ``model`` (a plain ``Transformer``, or a pipeline part of one) across ``group``."""
    if group.size == 1:
        return model
    sp = sequence_parallel
    columns = Columns(group, sp, overlap)
    kv_shards = min(group.size, model.cfg.kv_heads)
    if model.first:
        model.embed_tokens = VocabEmbedding(model.embed_tokens.weight, group, sp)
        _cut(placements, "embed_tokens.weight", 0, group.size, group.rank)
    for i, block in model.layers.items():
        p = f"layers.{i}."
        attn: Attention = block.self_attn
        _columns(attn, p + "self_attn.", ("q_proj",), group, columns, placements, group.size)
        _columns(attn, p + "self_attn.", ("k_proj", "v_proj"), group, columns, placements,
                 kv_shards)
        _row(attn, p + "self_attn.", "o_proj", group, sp, placements)
        if hasattr(attn, "q_norm"):  # whole on every rank, each applied to its own heads only:
            # the gradients are partial over tp with or without SP (q and k are whole-sequence)
            _sum_over(placements, attn.q_norm, p + "self_attn.q_norm.", "tp")
            _sum_over(placements, attn.k_norm, p + "self_attn.k_norm.", "tp")
        if hasattr(block, "mlp"):
            _mlp(block.mlp, p + "mlp.", group, columns, sp, placements)
        if sp:  # norms run on the sequence shard: their weights' gradients are partial
            _sum_over(placements, block.input_layernorm, p + "input_layernorm.", "tp")
            _sum_over(placements, block.post_attention_layernorm,
                      p + "post_attention_layernorm.", "tp")
    for moe in moe_layers(model):
        p = f"layers.{moe.layer}.block_sparse_moe."
        if model.cfg.shared_expert:
            _mlp(moe.shared_expert, p + "shared_expert.", group, columns, sp, placements)
            if sp and model.cfg.shared_expert_gate:  # the gate reads the sequence shard
                _sum_over(placements, moe.shared_expert_gate, p + "shared_expert_gate.", "tp")
        if sp:  # each tp rank routes its own sequence shard
            _sum_over(placements, moe.gate, p + "gate.", "tp")
            _sum_over(placements, moe.experts, p + "experts.", "tp")
            add_count_reduction(moe, group)
    if model.last:
        if sp:
            _sum_over(placements, model.norm, "norm.", "tp")
        if isinstance(model.lm_head, L.TiedHead):
            model.lm_head = TiedVocabHead(model.embed_tokens, columns)
        else:
            model.lm_head = VocabHead(model.lm_head.weight, group, columns)
            _cut(placements, "lm_head.weight", 0, group.size, group.rank)
        model.loss = VocabParallelLoss(group)
    return model


# ---------------------------------------------------------------------------- the formula


def tp_traffic_bytes(model: Any, par: Any, micro_batch: int, pp_rank: int = 0
                     ) -> dict[str, float]:
    """Bytes one rank sends over the tp group in one optimizer step, by collective.

    ``micro_batch`` sequences per micro-batch (par.micro_batches of them), ``s`` = seq_len / cp,
    ``A = micro_batch·s·h·dtype_bytes``. Per micro-batch:

    * each block: 2 forward + 2 backward all-reduces of A (SP: 2 all-gathers + 2 reduce-scatters
      of A each way, and 2 more backward all-gathers: the column inputs, saved as shards,
      gathered again for the weight gradients); full recompute reruns the forward up to its
      last saved tensor: +1 all-reduce (SP: +2 all-gathers, +1 reduce-scatter);
    * replicated kv heads (tp > kv_heads): per block 2 all-reduces of the full (kv_heads·d, h)
      weight gradient (wk, wv), and with ``qkv_bias`` 2 of the (kv_heads·d) bias gradient;
    * embedding: 1 forward all-reduce of A (SP: reduce-scatter forward, all-gather backward);
    * head (or tied head): 1 backward all-reduce of A (SP: all-gather forward, all-gather and
      reduce-scatter backward);
    * loss: all-reduce of micro_batch·s fp32 maxima and of 2·micro_batch·s fp32 (sum-exp, target).

    Per step: with SP, one all-reduce of each norm weight's gradient (2 per block + final norm);
    with ``qk_norm``, with or without SP, one of each q/k norm gain's (head_dim, 2 per block).
    A MoE block without a shared expert has only the attention's cut (its routed experts are
    whole on every tp rank). The ledger (``fived.ledger.traffic.tp_traffic``) holds the formula;
    this sums its collectives by op for the rank at pipeline coordinate ``pp_rank``.
    """
    out: dict[str, float] = {}
    for c in tp_traffic(model, par, micro_batch, pp_rank):
        out[c.op] = out.get(c.op, 0.0) + c.bytes
    return {k: v for k, v in out.items() if v}
