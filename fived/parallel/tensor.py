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

``apply_tp(model, group, placements, sequence_parallel, overlap)`` cuts a plain model as the
plan ``TP_PLAN`` says: a table of rows (module name pattern, cut, condition), torchtitan's
``parallelize_module(model, {"attention.wq": ColwiseParallel(), ...})`` in fived's names.
``apply_tp`` walks the model's modules in order and applies to each the first row whose pattern
names it (``*`` is one name part: ``layers.*.mlp.up_proj``) and whose condition holds. The cuts:

    Column(shards)  nn.Linear -> ColumnLinear, weight (+ bias) cut on the output features in
                    "tp" chunks, or "kv" = min(tp, kv_heads) chunks (k/v: replicated kv heads)
    Row             nn.Linear -> RowLinear, weight cut on the input features in tp chunks
    Vocab           the embedding -> VocabEmbedding, vocab rows in tp chunks
    VocabOut        the head -> VocabHead (vocab rows), or TiedVocabHead over the cut embedding
    VocabLoss       the loss -> VocabParallelLoss
    Partial         whole on every rank, its gradient partial over tp (``grad_sum += ("tp",)``):
                    the q/k norms always; the RMSNorms, the router, the routed experts and the
                    shared-expert gate under sequence parallelism (they see a sequence shard)
    RoutedCounts    a MoE layer under SP: its routed counts are summed over tp
                    (``fived.parallel.counts``)

A module a model lacks (q/k norms, the MLP of a MoE block, the shared expert, the embedding of a
later pipeline part) matches no row; a row whose condition is false (``SP`` without SP)
leaves its module whole with a complete gradient. Every parameter must lie under a module some
row names: a parameter no row names is an error, not a silent replica. A new module adds rows,
not branches: MLA's per-head up-projections are ``Column`` rows, its down-projections and latent
norms ``Partial`` rows under SP, and its rotary key, read by every head, the one new kind of cut
(``SharedKey``: forward identity, backward all-reduce; with SP all-gather / reduce-scatter). Each cut
records itself in the parameters' ``Placement``. The column layers of one model share one
``Columns`` object: the layers that read the same input (q/k/v; gate/up) share its gathered copy
and the reduction of its gradient.
``tp_traffic_bytes`` below is the formula for every byte the tp group sends in one step.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import autograd, ops
from ..ledger.traffic import tp_traffic
from ..model import layers as nn_layers
from ..model.init import shard
from ..model.llama import Transformer
from .counts import add_count_reduction
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

    def matmul(self, x: torch.Tensor, w: torch.Tensor, linear: Callable = F.linear
               ) -> torch.Tensor:
        """x Wᵀ for a column-cut W, x the (sequence shard of the) input; ``linear`` another
        product (fp8: ``fived.parallel.fp8``) over the full input, through plain autograd."""
        if linear is not F.linear:
            full = self._region(x, lambda t: (autograd.gather_from(t, self.group, 1) if self.sp
                                              else autograd.copy_to(t, self.group)))
            return linear(full, w)
        if not self.overlap and not self.sp:
            return F.linear(self._region(x, lambda t: autograd.copy_to(t, self.group)), w)
        region = self._region(x, lambda t: _Region(self.group, self.sp, self.overlap, t))
        return _ColumnMatmul.apply(x, w, region)


def exit_rows(y: torch.Tensor, group: Any, sp: bool) -> torch.Tensor:
    """The output of a row-parallel layer: partial sums reduced (to the sequence shard with SP)."""
    return autograd.scatter_to(y, group, dim=1) if sp else autograd.reduce_from(y, group)


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
        self.linear: Callable = F.linear  # the product (fp8: fived.parallel.fp8)

    def _replica(self, w: torch.Tensor) -> torch.Tensor:
        """w, its gradient summed over the ranks holding the same chunk (replicated kv)."""
        if self.shards < self.group.size:
            return _ReplicaGradSum.apply(w, self.group, self.shards, self.index)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.columns.matmul(x, self._replica(self.weight), self.linear)
        return y if self.bias is None else y + self._replica(self.bias)


class RowLinear(nn.Module):
    """y = Σ_i x_i W_iᵀ with W's input features cut across tp; the partial sums are reduced."""

    def __init__(self, full: torch.Tensor, group: Any, sequence_parallel: bool):
        super().__init__()
        self.group, self.sp = group, sequence_parallel
        self.weight = _piece(full, 1, group.size, group.rank)
        self.linear: Callable = F.linear  # the product (fp8: fived.parallel.fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exit_rows(self.linear(x, self.weight), self.group, self.sp)


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
        inside = (local >= 0) & (local < v)  # an ignored target (IGNORE) is inside no slice
        idx = local.clamp(0, v - 1)
        target_z = z.gather(-1, idx.unsqueeze(-1)).squeeze(-1) * inside
        both = torch.stack([ez.sum(-1), target_z])
        ops.all_reduce(both, group)
        sumexp, target_z = both[0].clone(), both[1]  # sumexp alone is kept
        # one copy of the logits, in their own dtype, and two fp32 numbers per token: the
        # softmax of the local slice is recomputed in backward by the same ops (same bits)
        # an ignored token (target IGNORE, inside no slice) keeps an infinite Σexp: its
        # softmax, and so its gradient row, is zero
        valid = targets != nn_layers.IGNORE
        ctx.save_for_backward(logits, m, torch.where(valid, sumexp, torch.inf), idx, inside)
        return torch.where(valid, sumexp.log() - target_z, 0.0).sum()

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


# ---------------------------------------------------------------------------- the plan

class _TP:
    """What a cut needs while ``apply_tp`` runs: the model (or part) being cut, the tp group,
    the placements, sequence parallelism, and the model's one ``Columns``."""

    def __init__(self, model: nn.Module, group: Any, placements: dict[str, Placement],
                 sp: bool, columns: Columns):
        self.model, self.group, self.placements = model, group, placements
        self.sp, self.columns = sp, columns

    def shards(self, which: str) -> int:
        """"tp": one chunk per rank; "kv": min(tp, kv_heads) chunks (replicated kv heads)."""
        return min(self.group.size, self.model.cfg.kv_heads) if which == "kv" else self.group.size

    def swap(self, name: str, new: nn.Module) -> None:
        parent, _, leaf = name.rpartition(".")
        setattr(self.model.get_submodule(parent), leaf, new)

    def cut(self, name: str, dim: int, parts: int, index: int) -> None:
        self.placements[name] = self.placements[name].cut(dim, parts, index)

    def sum_over(self, name: str, module: nn.Module) -> None:
        """Gradients of ``module``'s (whole, replicated) parameters are partial over tp."""
        for n, _ in module.named_parameters(prefix=name):
            pl = self.placements[n]
            self.placements[n] = replace(pl, grad_sum=pl.grad_sum + ("tp",))


class Cut:
    """What ``apply_tp`` does to a module a row of the plan names. ``places``: the cut decides
    the placement of every parameter under the module (the coverage check counts them)."""

    places = True

    def apply(self, t: _TP, name: str, module: nn.Module) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Column(Cut):
    """``nn.Linear`` -> ``ColumnLinear``: weight (and bias) cut on the output features in
    ``shards`` chunks, "tp" or "kv" (min(tp, kv_heads): the kv heads)."""

    shards: str = "tp"

    def apply(self, t: _TP, name: str, module: nn.Module) -> None:
        lin = ColumnLinear(module.weight, t.group, t.columns, t.shards(self.shards), module.bias)
        t.swap(name, lin)
        for kind in ("weight",) + (("bias",) if lin.bias is not None else ()):
            t.cut(f"{name}.{kind}", 0, lin.shards, lin.index)


@dataclass(frozen=True)
class Row(Cut):
    """``nn.Linear`` -> ``RowLinear``: weight cut on the input features in tp chunks."""

    def apply(self, t: _TP, name: str, module: nn.Module) -> None:
        t.swap(name, RowLinear(module.weight, t.group, t.sp))
        t.cut(f"{name}.weight", 1, t.group.size, t.group.rank)


@dataclass(frozen=True)
class Vocab(Cut):
    """``nn.Embedding`` -> ``VocabEmbedding``: vocab rows cut in tp chunks."""

    def apply(self, t: _TP, name: str, module: nn.Module) -> None:
        t.swap(name, VocabEmbedding(module.weight, t.group, t.sp))
        t.cut(f"{name}.weight", 0, t.group.size, t.group.rank)


@dataclass(frozen=True)
class VocabOut(Cut):
    """The head -> ``VocabHead`` (vocab rows cut in tp chunks); a tied head ->
    ``TiedVocabHead`` over the embedding the ``Vocab`` row cut (registered, and placed, there:
    ``embed_tokens`` comes first in every model that holds both)."""

    def apply(self, t: _TP, name: str, module: nn.Module) -> None:
        if isinstance(module, nn_layers.TiedHead):
            t.swap(name, TiedVocabHead(t.model.get_submodule("embed_tokens"), t.columns))
            return
        t.swap(name, VocabHead(module.weight, t.group, t.columns))
        t.cut(f"{name}.weight", 0, t.group.size, t.group.rank)


@dataclass(frozen=True)
class VocabLoss(Cut):
    """The token loss -> ``VocabParallelLoss`` over the vocab-cut logits."""

    def apply(self, t: _TP, name: str, module: nn.Module) -> None:
        t.swap(name, VocabParallelLoss(t.group))


@dataclass(frozen=True)
class Partial(Cut):
    """Whole on every rank (replicated), but each rank's gradient is partial over tp: the
    placements of every parameter under the module carry ``grad_sum += ("tp",)``."""

    def apply(self, t: _TP, name: str, module: nn.Module) -> None:
        t.sum_over(name, module)


@dataclass(frozen=True)
class RoutedCounts(Cut):
    """A MoE layer whose sequences tp cuts (SP): its routed counts are summed over tp."""

    places = False

    def apply(self, t: _TP, name: str, module: nn.Module) -> None:
        add_count_reduction(module, t.group)


class SharedKeyRegion(nn.Module):
    """MLA's rotary key kᴿ, which every head reads: forward identity (SP: all-gather of the
    sequence), backward all-reduce of its partial gradient (SP: reduce-scatter)."""

    def __init__(self, group: Any, sequence_parallel: bool):
        super().__init__()
        self.group, self.sp = group, sequence_parallel

    def forward(self, k: torch.Tensor) -> torch.Tensor:
        return (autograd.gather_from(k, self.group, dim=1) if self.sp
                else autograd.copy_to(k, self.group))


@dataclass(frozen=True)
class SharedKey(Cut):
    """MLA's ``rope_key`` -> ``SharedKeyRegion``: the rotary key shared by the heads tp cuts."""

    places = False

    def apply(self, t: _TP, name: str, module: nn.Module) -> None:
        t.swap(name, SharedKeyRegion(t.group, t.sp))


def always(t: _TP) -> bool:
    return True


def under_sp(t: _TP) -> bool:
    """With sequence parallelism (the module sees this rank's sequence shard)."""
    return t.sp


class PlanRow(NamedTuple):
    """``pattern``: a module name, ``*`` standing for one name part (``layers.*.mlp``);
    ``cut``: what to do with it; ``when``: the condition (false: the module stays whole,
    replicated with a complete gradient)."""

    pattern: str
    cut: Cut
    when: Callable[[_TP], bool] = always


ATTN, MLP = "layers.*.self_attn.", "layers.*.mlp."
MOE, SHARED = "layers.*.block_sparse_moe", "layers.*.block_sparse_moe.shared_expert."
SP = under_sp

TP_PLAN: tuple[PlanRow, ...] = (
    PlanRow("embed_tokens", Vocab()),
    # attention: heads cut (q/k/v column, o row); kv chunks held by tp/kv_heads ranks when
    # tp > kv_heads; the q/k norm gains act on this rank's heads only, with or without SP
    PlanRow("layers.*.input_layernorm", Partial(), SP),
    PlanRow(ATTN + "q_proj", Column()),
    PlanRow(ATTN + "k_proj", Column(shards="kv")),
    PlanRow(ATTN + "v_proj", Column(shards="kv")),
    PlanRow(ATTN + "o_proj", Row()),
    PlanRow(ATTN + "q_norm", Partial()),
    PlanRow(ATTN + "k_norm", Partial()),
    # MLA (fived.model.mla), as Megatron-Core cuts it: the down-projections and the latent
    # norms whole on every rank (under SP on this rank's sequence shard: gradients partial);
    # the per-head up-projections column-cut (their region gathers the latent, not x, with
    # SP); the rotary key every head reads summed over tp (gathered with SP); o_proj above
    PlanRow(ATTN + "q_a_proj", Partial(), SP),
    PlanRow(ATTN + "q_a_layernorm", Partial(), SP),
    PlanRow(ATTN + "q_b_proj", Column()),
    PlanRow(ATTN + "kv_a_proj_with_mqa", Partial(), SP),
    PlanRow(ATTN + "kv_a_layernorm", Partial(), SP),
    PlanRow(ATTN + "kv_b_proj", Column()),
    PlanRow(ATTN + "rope_key", SharedKey()),
    # the dense MLP: ffn cut (gate/up column, down row)
    PlanRow("layers.*.post_attention_layernorm", Partial(), SP),
    PlanRow(MLP + "gate_proj", Column()),
    PlanRow(MLP + "up_proj", Column()),
    PlanRow(MLP + "down_proj", Row()),
    # the MoE layer: router and routed experts whole on every tp rank (apply_ep splits the
    # experts); under SP each rank routes its sequence shard; the shared expert is an MLP
    PlanRow(MOE, RoutedCounts(), SP),
    PlanRow(MOE + ".gate", Partial(), SP),
    PlanRow(MOE + ".experts", Partial(), SP),
    PlanRow(SHARED + "gate_proj", Column()),
    PlanRow(SHARED + "up_proj", Column()),
    PlanRow(SHARED + "down_proj", Row()),
    PlanRow(MOE + ".shared_expert_gate", Partial(), SP),
    # the last part: final norm, vocab-cut head (or the tied embedding) and loss
    PlanRow("norm", Partial(), SP),
    PlanRow("lm_head", VocabOut()),
    PlanRow("loss", VocabLoss()),
    # multi-token prediction: each module's block is cut by the block rows above (its names
    # "mtp.{k}.block.X" match them as "layers.{k}.X": ``_plan_name``); its norms and eh_proj
    # (2h -> h) stay whole on every tp rank, partial over tp under SP (a sequence shard)
    PlanRow("mtp.*.enorm", Partial(), SP),
    PlanRow("mtp.*.hnorm", Partial(), SP),
    PlanRow("mtp.*.eh_proj", Partial(), SP),
    PlanRow("mtp.*.norm", Partial(), SP),
)


def _plan_name(name: str) -> str:
    """The name a module matches the plan under: a multi-token prediction block's modules
    (``mtp.{k}.block.X``) as a trunk block's (``layers.{k}.X``), so every block row — those
    of any attention or feed-forward a block is built with — cuts them alike."""
    return re.sub(r"^mtp\.(\d+)\.block(\.|$)", r"layers.\1\2", name)


def _matcher(pattern: str) -> re.Pattern:
    return re.compile(r"\.".join("[^.]+" if p == "*" else re.escape(p)
                                 for p in pattern.split(".")))


def apply_tp(model: Transformer, group: Any, placements: dict[str, Placement],
             sequence_parallel: bool = False, overlap: bool = True,
             plan: tuple[PlanRow, ...] = TP_PLAN) -> Transformer:
    """Cut ``model`` (a plain ``Transformer``, or a pipeline part of one) across ``group`` as
    ``plan`` says: each module, in the model's order, gets the first row whose pattern names it
    and whose condition holds. Every parameter must lie under a module some row names (a
    module the model lacks matches nothing; a parameter no row names is an error)."""
    if group.size == 1:
        return model
    t = _TP(model, group, placements, sequence_parallel, Columns(group, sequence_parallel,
                                                                 overlap))
    rows = [(_matcher(r.pattern), r) for r in plan]
    named = [(name, module, [r for m, r in rows if m.fullmatch(_plan_name(name))])
             for name, module in model.named_modules()]
    covered = {n for name, module, mine in named if any(r.cut.places for r in mine)
               for n, _ in module.named_parameters(prefix=name)}
    missing = [n for n, _ in model.named_parameters() if n not in covered]
    if missing:
        raise ValueError(f"the tensor-parallel plan names no module holding {missing}")
    for name, module, mine in named:
        row = next((r for r in mine if r.when(t)), None)
        if row is not None:
            row.cut.apply(t, name, module)
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
