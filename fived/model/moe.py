"""Mixture of experts: top-k router, SwiGLU experts, balance and z auxiliary losses, capacity.

For a token x (hidden h) and E experts with router W_r (E × h), computed in fp32:

    logits = W_r x,   p = softmax(logits),   (v, i) = top-k(p),   w = ρ · v / Σ v
    y = Σ_j w_j · Expert_{i_j}(x)  [+ g(x) · SharedExpert(x)]
    ρ = ``routed_scaling_factor`` (1; DeepSeek-V3: 2.5); g(x) = σ(w_g · x) with
    ``shared_expert_gate`` (Qwen2-MoE), else 1; the shared expert is a dense SwiGLU of width
    ``shared_expert_ffn`` (tp-cut like any MLP, never expert-parallel)

Node-limited routing (``route_groups`` G, ``route_top_groups`` M, ``MoE.select``): top-k runs
over the experts of each token's M best groups only, so with G a multiple of ep (each ep rank
owns whole groups) a token's rows go to at most M ep ranks.

Capacity (``capacity_factor`` c > 0) is applied **per sequence**: each expert accepts at most
C = ⌈c · s · k / E⌉ of one sequence's s·k assignments, in priority order (all first choices in
position order, then all second choices ...); the rest are dropped (contribute 0). Because a
sequence is never split by dp, ep, tp or pipeline micro-batches, what is dropped does not depend
on the layout. ``capacity_factor = 0`` is dropless.

Auxiliary losses, with the same convention as the cross-entropy (a sum over this rank's
sequences/tokens, normalised by the *global* counts, gradients summed over the groups):

    balance (Switch/GShard, per sequence q):  B_q = E · Σ_e f_{q,e} · P_{q,e}
        f_{q,e} = share of q's s·k assignments routed to e (before dropping, no gradient)
        P_{q,e} = mean over q's tokens of p_e
    aux  = aux_loss_coef · Σ_q B_q / global_sequences
    z    = z_loss_coef  · Σ_t logsumexp(logits_t)² / global_tokens

Both totals are sums over sequences/tokens, so any layout that splits the batch by whole
sequences gives exactly the one-rank value and gradient. Their gradient is injected without
changing what the model returns: ``_AuxGrad`` is the identity on the MoE output in forward and,
in backward, hands the local aux sum the gradient ``aux_grad_scale`` (= 1/global_tokens;
global_sequences = global_tokens / seq_len, hence the factor seq_len below) — the
"aux-loss auto-scaler" trick. The trainer sets that gradient once per step for every MoE layer
with ``set_aux_grad_scale(model, 1/global_tokens × fp16 loss scale)``; 0 (the default) gives the
auxiliary losses no gradient.

The layer is plain: it holds every expert and computes them locally. Two attributes let the
parallel dimensions plug in without the layer knowing them (``fived.parallel.expert``,
``fived.parallel.context``, ``fived.parallel.tensor``):

* ``dispatch(rows, counts, compute)``: rows sorted by global expert (``counts`` per expert) ->
  their outputs in the same order; ``None`` = all experts are here. Expert parallelism keeps
  E/ep contiguous experts on a rank and sends rows to their owners by all-to-all;
* ``dispatch_tokens(x, tok, w, counts, compute)`` instead (``ep_dispatch = tokens``): the
  tokens, and each kept assignment's token and weight sorted by expert -> the routed output;
  the owners weight and sum their experts' outputs, so one row per (token, ep rank) travels;
* ``reduce_counts(routed)``: sums the per-sequence routed counts over the ranks that hold other
  parts of the same sequences (cp, and tp under sequence parallelism); ``None`` = identity.

Expert weights are replicated over tp (never cut): each tp rank holds full experts and the full
router. Without sequence parallelism every tp rank routes the same tokens and gets the same full
gradients, so nothing is reduced over tp (like a norm weight). With SP each tp rank routes its
own sequence shard, so router and expert gradients are summed over tp (their placement's
``grad_sum``).

When a sequence is cut across ranks (cp, and tp under SP) the balance loss stays exact: the
per-sequence routed counts are summed over those groups (an all-reduce of b·E fp32 per layer
forward, charged to cp / tp) and P is normalised by the full sequence length, so the shards'
E·Σ_e f·P_local add up to B_q. Capacity is then applied per local shard, with C from the local
length (exact only when dropless).

Loss-free balancing (``balance = "bias"``, DeepSeek-V3): a per-expert buffer ``route_bias`` b
is added to the scores for the choice only, top-k(s + b), the weights staying those of s; after
each optimizer step the route balancer (``fived.parallel.balance.RouteBalancer``) moves it by
the step's global load, b_e ← b_e + γ · sign(c̄ − c_e) (the counts: ``routed_per_expert``,
assignments before dropping, summed over the batch group by the balancer). ``aux_loss_coef``
then weighs the (per-sequence) balance loss as DeepSeek-V3's complementary one; 0 for none.

The module keeps the selection bias buffer and one ``RoutingStats`` (tokens per expert, routed
assignments, dropped assignments, the local aux sums, the token rows sent) of the forwards since
its last reset: ``fived.parallel.expert.collect_stats`` and the route balancer
(``fived.parallel.balance``) read them once per step, ``collect_stats`` resets them, and an
evaluation takes a ``snapshot`` and restores it (its forwards are no training step's).
Names follow Mixtral: ``block_sparse_moe.gate`` (the router), ``experts.{e}.w1/w3/w2`` (gate, up,
down), and ``shared_expert.{gate,up,down}_proj`` with ``shared_expert_gate`` (Qwen2-MoE's names).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from . import grouped as grouped_gemm
from . import layers as nn_layers


class Expert(nn.Module):
    """One SwiGLU expert, Mixtral's names: w2(silu(w1 x) ⊙ w3 x)."""

    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.w3 = nn.Linear(hidden, ffn, bias=False, dtype=dtype)
        self.w2 = nn.Linear(ffn, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn_layers.swiglu(self.w1(x), self.w3(x)))


class _RouterLogits(torch.autograd.Function):
    """logits = x W_rᵀ in fp32 (x, W_r in the compute dtype). Saves the fp32 copy of x only —
    autograd would also keep W_r's fp32 copy (h·E·4 bytes per layer and micro-batch in bf16);
    backward re-casts the parameter and runs the kernels autograd runs (the same bits)."""

    @staticmethod
    def forward(ctx, x, w):
        x32 = x.float()
        ctx.save_for_backward(x32)
        ctx.w, ctx.dtype = w, x.dtype  # the parameter itself (ZeRO-3 refills it in time)
        return F.linear(x32, w.float())

    @staticmethod
    def backward(ctx, g):
        (x32,) = ctx.saved_tensors
        w = ctx.w
        dx = g.matmul(w.float()).to(ctx.dtype) if ctx.needs_input_grad[0] else None
        dw = g.t().matmul(x32).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw


class _AuxGrad(torch.autograd.Function):
    """Identity on ``out``; in backward gives the scalar ``aux`` the gradient ``scale``."""

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, g):
        return g, torch.full((), ctx.scale, dtype=torch.float32, device=g.device), None


class _Combine(torch.autograd.Function):
    """out_t = Σ_j w_{t,j} · slot_{t,j}, the slots being the expert outputs ``y`` (sorted by
    expert) put back at token-major positions ``sel`` (dropped assignments: 0). Saves ``y``,
    the fp32 weights and ``sel`` only — autograd would keep ``y`` for the scatter and the
    scattered slots for the product (two more copies of k·h per token); backward rebuilds the
    slots and runs the kernels autograd runs, so the gradients are the same bits."""

    @staticmethod
    def slots(y, sel, n, k):
        """The (n, k, h) un-permuted slots: row sel[i] of the flat (n·k, h) is y[i]."""
        return y.new_zeros(n * k, y.shape[-1]).index_copy(0, sel, y).view(n, k, -1)

    @staticmethod
    def forward(ctx, y, weights, sel, k):
        ctx.save_for_backward(y, weights, sel)
        slots = _Combine.slots(y, sel, weights.shape[0], k)
        return (slots * weights.unsqueeze(-1).to(y.dtype)).sum(1)

    @staticmethod
    def backward(ctx, g):
        y, weights, sel = ctx.saved_tensors
        n, k = weights.shape
        h = y.shape[-1]
        w = weights.unsqueeze(-1).to(y.dtype)
        gs = g.unsqueeze(1).expand(n, k, h)  # the sum's backward
        dy = (gs * w).reshape(n * k, h).index_select(0, sel)
        dw = (gs * _Combine.slots(y, sel, n, k)).sum(-1).to(weights.dtype)
        return dy, dw, None, None


def route_scores(cfg: ModelConfig, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, E) fp32 router logits -> (the scores top-k chooses and weights from, the
    distribution the balance loss uses): softmax: both p = softmax(logits); sigmoid:
    σ(logits), and σ normalised over the experts (DeepSeek-V3's sequence-wise balance)."""
    if cfg.router == "sigmoid":
        s = torch.sigmoid(logits)
        return s, s / s.sum(dim=-1, keepdim=True)
    p = logits.softmax(dim=-1)
    return p, p


def capacity(cfg: ModelConfig, tokens_per_sequence: int) -> int:
    """Per-sequence, per-expert capacity C = ⌈c · s · k / E⌉ (a huge number when dropless)."""
    if cfg.capacity_factor <= 0:
        return 1 << 62
    return int(math.ceil(cfg.capacity_factor * tokens_per_sequence * cfg.top_k / cfg.experts))


def capacity_keep(top_idx: torch.Tensor, experts: int, cap: int) -> torch.Tensor:
    """(b, s, k) expert ids -> (b, s, k) bool: kept within each sequence's per-expert capacity.

    Priority: choice j before choice j+1, then position order (GShard's ordering)."""
    b, s, k = top_idx.shape
    order = top_idx.transpose(1, 2).reshape(b, k * s)  # choice-major, then position
    oh = F.one_hot(order, experts)
    slot = (oh.cumsum(dim=1) * oh).sum(-1)  # 1-based place in that expert's queue
    return (slot <= cap).view(b, k, s).transpose(1, 2)


def _in_backward() -> bool:
    """True while autograd runs (e.g. a checkpoint recompute): statistics are not re-counted."""
    fn = getattr(torch._C, "_current_graph_task_id", None)
    return fn is not None and fn() != -1


@dataclass
class RoutingStats:
    """One MoE layer's routing over the forwards since its last reset (one training step)."""

    tokens_per_expert: torch.Tensor  # (E,) float64: kept rows per expert
    routed_per_expert: torch.Tensor  # (E,) int64: assignments before dropping, whole sequences
    dropped: float = 0.0  # dropped token-assignments
    balance_sum: float = 0.0  # Σ_q B_q over this rank's sequences
    z_sum: float = 0.0  # Σ_t logsumexp² over this rank's tokens
    forwards: int = 0
    sent_rows: torch.Tensor | None = None  # ep_dispatch = tokens: rows sent per ep rank

    @classmethod
    def zeros(cls, experts: int) -> RoutingStats:
        return cls(torch.zeros(experts, dtype=torch.float64),
                   torch.zeros(experts, dtype=torch.int64))

    def snapshot(self) -> RoutingStats:
        """A copy that later forwards do not change (tensors cloned)."""
        return RoutingStats(**{f.name: (v.clone() if isinstance(v, torch.Tensor) else v)
                               for f in fields(self) for v in [getattr(self, f.name)]})


class MoE(nn.Module):
    """The MoE feed-forward of block ``layer``; input and output (b, s, h)."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.gate = nn.Linear(cfg.hidden, cfg.experts, bias=False, dtype=dtype)
        self.experts = nn.ModuleDict(
            {str(e): Expert(cfg.hidden, cfg.expert_ffn, dtype) for e in range(cfg.experts)})
        if cfg.shared_expert:
            self.shared_expert = nn_layers.MLP(cfg.hidden, cfg.shared_ffn, dtype)
            if cfg.shared_expert_gate:  # Qwen2-MoE: σ(w·x) scales the shared expert per token
                self.shared_expert_gate = nn.Linear(cfg.hidden, 1, bias=False, dtype=dtype)
        if cfg.balance == "bias":  # loss-free balancing: a buffer, updated after each step
            self.register_buffer("route_bias", torch.zeros(cfg.experts, dtype=torch.float32))
        self.dispatch: Callable | None = None
        self.dispatch_tokens: Callable | None = None
        self.reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.aux_grad_scale = 0.0
        self.keep_aux = False  # tests: keep the last aux tensor (with its graph) in last_aux
        self.count_stats = True  # the dry run (fake tensors, no values) counts nothing
        self.last_aux: torch.Tensor | None = None
        self.reset_stats()

    # ------------------------------------------------------------------ statistics
    def reset_stats(self) -> None:
        self.stats = RoutingStats.zeros(self.cfg.experts)

    # ------------------------------------------------------------------ compute
    def select(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """(N, E) routing scores -> (N, k) chosen experts, in descending order of score (with
        balance = bias, of score + bias: the bias steers the choice, never the weights).

        Node-limited (``route_groups`` G, ``route_top_groups`` M): the E experts form G
        contiguous groups; a group's score is the sum of its best two selection scores
        (DeepSeek-V3; its best one when a group has one expert), and a token chooses its k
        experts among the M best groups' only."""
        cfg = self.cfg
        if cfg.balance == "bias":
            scores = scores + self.route_bias
        if cfg.node_limited:
            n, G = scores.shape[0], cfg.route_groups
            grouped = scores.view(n, G, -1)
            best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # (N, G)
            top_g = best.topk(cfg.route_top_groups, dim=-1).indices
            allowed = torch.zeros_like(best, dtype=torch.bool).scatter_(1, top_g, True)
            scores = grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(n, -1)
        return scores.topk(k, dim=-1).indices

    @property
    def local_experts(self) -> list[int]:
        return sorted(int(e) for e in self.experts)

    def compute_local(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by local expert (``counts[j]`` rows for local expert j) -> outputs: one
        grouped operation (``fived.model.grouped``) or a loop over the experts, as
        ``cfg.expert_matmul`` says."""
        experts = [self.experts[str(e)] for e in self.local_experts]
        cfg = self.cfg
        if experts and grouped_gemm.use_grouped(cfg.expert_matmul, rows, cfg.hidden, cfg.expert_ffn):
            return grouped_gemm.grouped_experts(rows, counts, experts)
        outs = [ex(chunk) for ex, chunk in zip(experts, torch.split(rows, counts))]
        return torch.cat(outs) if outs else rows

    def assign(self, top_i: torch.Tensor, keep: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The kept assignments (token-major index t·k + j) sorted by expert: their indices
        ``sel``, the rows per expert (a tensor, and as ints). The one data-dependent step (the
        dry run swaps in uniform routing here, ``fived.train.dryrun``)."""
        flat_e = top_i.reshape(-1)
        kept_idx = keep.nonzero().squeeze(1)
        e_kept = flat_e[kept_idx]
        order = torch.argsort(e_kept, stable=True)
        counts = torch.bincount(e_kept, minlength=self.cfg.experts)
        return kept_idx[order], counts, counts.tolist()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(b, s, h) -> (b, s, h); s may be this rank's part of each sequence."""
        x = x.contiguous()  # a strided SP shard: one copy the router and shared expert share
        out = self.moe(x)
        if not self.cfg.shared_expert:
            return out
        shared = self.shared_expert(x)
        if self.cfg.shared_expert_gate:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared

    def moe(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts."""
        cfg = self.cfg
        E, k = cfg.experts, cfg.top_k
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        logits = _RouterLogits.apply(flat, self.gate.weight)  # (N, E) fp32
        scores, probs = route_scores(cfg, logits)
        top_i = self.select(scores, k)  # (N, k)
        top_p = scores.gather(-1, top_i)  # the unbiased scores of the chosen experts
        weights = top_p / top_p.sum(dim=-1, keepdim=True) if cfg.norm_topk_prob else top_p
        if cfg.routed_scaling_factor != 1.0:  # DeepSeek-V3: 2.5
            weights = weights * cfg.routed_scaling_factor
        keep = capacity_keep(top_i.view(b, s, k), E, capacity(cfg, s)).reshape(-1)

        # auxiliary losses (local sums; see the module docstring for the normalisation)
        routed = F.one_hot(top_i.view(b, s * k), E).sum(1).float()  # (b, E), before dropping
        if self.reduce_counts is not None:  # the whole sequence's counts
            routed = self.reduce_counts(routed)
        s_full = routed.sum(-1, keepdim=True) / k  # (b, 1): tokens of each whole sequence
        f = routed / (s_full * k)
        P = probs.view(b, s, E).sum(1) / s_full  # this shard's part of the sequence mean
        balance = E * (f * P).sum()
        z = torch.logsumexp(logits, dim=-1).pow(2).sum()

        sel, counts, sizes = self.assign(top_i, keep)
        sent = None
        if self.dispatch_tokens is not None:  # the owners combine: one row per (token, rank)
            out, sent = self.dispatch_tokens(flat, sel // k, weights.reshape(-1)[sel], counts,
                                             self.compute_local)
            out = out.view(b, s, h).to(x.dtype)
        else:
            rows = flat[sel // k]
            if self.dispatch is not None:
                y = self.dispatch(rows, counts, self.compute_local)
            else:
                y = self.compute_local(rows, sizes)
            # un-permute into (N, k, h) slots (dropped ones stay 0), weight in fixed k order
            out = _Combine.apply(y, weights, sel, k).view(b, s, h).to(x.dtype)

        if self.count_stats and not _in_backward():
            st = self.stats
            st.forwards += 1
            st.tokens_per_expert += counts.double().cpu()
            st.routed_per_expert += routed.detach().long().sum(0).cpu()
            st.dropped += float(keep.numel() - sel.numel())
            st.balance_sum += float(balance.detach())
            st.z_sum += float(z.detach())
            if sent is not None:
                sent = torch.tensor(sent, dtype=torch.float64)
                st.sent_rows = sent if st.sent_rows is None else st.sent_rows + sent
        aux = cfg.aux_loss_coef * cfg.seq_len * balance + cfg.z_loss_coef * z
        if self.keep_aux:
            self.last_aux = aux
        if torch.is_grad_enabled() and aux.requires_grad:
            out = _AuxGrad.apply(out, aux, self.aux_grad_scale)
        return out


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_aux_grad_scale(model: nn.Module, scale: float) -> None:
    """d(step loss)/d(local aux sum) for every MoE layer: 1/global_tokens (× the fp16 scale)."""
    for m in moe_layers(model):
        m.aux_grad_scale = float(scale)


# ---------------------------------------------------------------------------- loss-free balancing

def bias_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of ``model`` that carry a selection bias (balance = bias), by layer."""
    return sorted((m for m in moe_layers(model) if m.cfg.balance == "bias"),
                  key=lambda m: m.layer)


def materialize_route_bias(model: nn.Module, device: torch.device | str) -> None:
    """Each bias layer's ``route_bias`` (built on meta with the model) as fp32 zeros on
    ``device``; a checkpoint's values are loaded into it afterwards."""
    for m in bias_layers(model):
        if m.route_bias.is_meta or m.route_bias.device.type != torch.device(device).type:
            m.route_bias = torch.zeros(m.cfg.experts, dtype=torch.float32, device=device)


def route_bias_name(m: MoE) -> str:
    """The global name of a layer's bias (a checkpoint stores it as ``buffer.<name>``)."""
    return f"layers.{m.layer}.block_sparse_moe.route_bias"
