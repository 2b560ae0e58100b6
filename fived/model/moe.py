"""Mixture of experts: top-k router, SwiGLU experts, balance and z auxiliary losses, capacity.

For a token x (hidden h) and E experts with router W_r (E × h), computed in fp32:

    logits = W_r x,   p = softmax(logits),   (v, i) = top-k(p),   w = v / Σ v
    y = Σ_j w_j · Expert_{i_j}(x)  [+ SharedExpert(x)]

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
in backward, hands the local aux sum the gradient ``plan.loss_scale`` (= 1/global_tokens, set by
the trainer; global_sequences = global_tokens / seq_len, hence the factor seq_len below) — the
"aux-loss auto-scaler" trick. An fp16 loss scaler must multiply ``plan.loss_scale`` too.

Expert parallelism (``fived.parallel.expert``): with ep > 1 an ep rank builds only its E/ep
contiguous experts, and routed rows travel by all-to-all to their owners and back.

Expert weights are replicated over tp (never cut): each tp rank holds full experts and the full
router. Without sequence parallelism every tp rank routes the same tokens and gets the same full
gradients, so nothing is reduced over tp (like a norm weight). With SP each tp rank routes its
own sequence shard, so router and expert gradients are summed over tp (``_fived_grad_reduce``).

When a sequence is cut across ranks (cp, and tp under SP) the balance loss stays exact: the
per-sequence routed counts are summed over those groups (an all-reduce of b·E fp32 per layer
forward, charged to cp / tp) and P is normalised by the full sequence length, so the shards'
E·Σ_e f·P_local add up to B_q. Capacity is then applied per local shard, with C from the local
length (exact only when dropless).

The module keeps per-step statistics (tokens per expert, dropped assignments, the local aux
sums) that ``fived.parallel.expert.collect_stats`` reads and resets once per step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import ops
from ..config import ModelConfig
from . import layers as L
from .llama import MLP, STD


class Expert(nn.Module):
    """One SwiGLU expert, full (never cut across tp): W_down(silu(W_gate x) ⊙ W_up x)."""

    def __init__(self, cfg: ModelConfig, prefix: str, seed: int, dtype: torch.dtype):
        super().__init__()
        h, f = cfg.hidden, cfg.expert_ffn
        self.w_gate = L.Linear(prefix + "w_gate", h, f, STD, seed, dtype=dtype)
        self.w_up = L.Linear(prefix + "w_up", h, f, STD, seed, dtype=dtype)
        self.w_down = L.Linear(prefix + "w_down", f, h, STD / math.sqrt(2 * cfg.layers), seed,
                               dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class _AuxGrad(torch.autograd.Function):
    """Identity on ``out``; in backward gives the scalar ``aux`` the gradient ``scale``."""

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, g):
        return g, torch.full((), ctx.scale, dtype=torch.float32), None


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


class MoE(nn.Module):
    """The MoE feed-forward of one block; input and output (b, s, h)."""

    def __init__(self, cfg: ModelConfig, plan: Any, prefix: str):
        super().__init__()
        self.cfg, self.plan = cfg, plan
        self.layer = int(prefix.split(".")[1]) if prefix.startswith("layers.") else 0
        E = cfg.experts
        self.ep_group = plan.group("ep")
        ep = 1 if self.ep_group is None else self.ep_group.size
        ep_rank = 0 if self.ep_group is None else self.ep_group.rank
        per = E // ep
        self.local_experts = list(range(ep_rank * per, (ep_rank + 1) * per))
        self.router = L.Linear(prefix + "router", cfg.hidden, E, STD, plan.seed, dtype=plan.dtype)
        self.experts = nn.ModuleDict(
            {str(e): Expert(cfg, f"{prefix}experts.{e}.", plan.seed, plan.dtype)
             for e in self.local_experts})
        for p in self.experts.parameters():
            p._fived_expert = True
        self.sequence_parallel = bool(plan.par.sequence_parallel and plan.tp > 1)
        if self.sequence_parallel:  # tokens differ per tp rank; replicated weights sum over tp
            for p in list(self.experts.parameters()) + list(self.router.parameters()):
                p._fived_grad_reduce = ("tp",)
        # the groups across which one sequence is cut (its routed counts are summed there)
        names = ["cp"] + (["tp"] if self.sequence_parallel else [])
        self.seq_groups = [g for g in map(plan.group, names) if g is not None and g.size > 1]
        self.shared = (MLP(cfg, plan, prefix + "shared_expert.", ffn=cfg.expert_ffn)
                       if cfg.shared_expert else None)
        self.keep_aux = False  # tests: keep the last aux tensor (with its graph) in last_aux
        self.last_aux: torch.Tensor | None = None
        self.reset_stats()

    # ------------------------------------------------------------------ statistics
    def reset_stats(self) -> None:
        self.tokens_per_expert = torch.zeros(self.cfg.experts, dtype=torch.float64)
        self.dropped = 0.0  # dropped token-assignments
        self.balance_sum = 0.0  # Σ_q B_q over this rank's sequences
        self.z_sum = 0.0  # Σ_t logsumexp² over this rank's tokens
        self.forwards = 0

    # ------------------------------------------------------------------ compute
    def compute_local(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows sorted by local expert (``counts[j]`` rows for local expert j) -> outputs."""
        outs = [self.experts[str(e)](chunk) for e, chunk in
                zip(self.local_experts, torch.split(rows, counts))]
        return torch.cat(outs) if outs else rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(b, s, h) -> (b, s, h); s is this rank's part of the sequence (cp, SP)."""
        out = self.moe(x)
        return out if self.shared is None else out + self.shared(x)

    def moe(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts."""
        cfg = self.cfg
        E, k = cfg.experts, cfg.top_k
        b, s, h = x.shape
        s_full = s * math.prod(g.size for g in self.seq_groups)
        flat = x.reshape(b * s, h)
        logits = F.linear(flat.float(), self.router.weight.float())  # (N, E) fp32
        probs = logits.softmax(dim=-1)
        top_p, top_i = probs.topk(k, dim=-1)  # (N, k), descending
        weights = top_p / top_p.sum(dim=-1, keepdim=True)
        keep = capacity_keep(top_i.view(b, s, k), E, capacity(cfg, s)).reshape(-1)

        # auxiliary losses (local sums; see the module docstring for the normalisation)
        routed = F.one_hot(top_i.view(b, s * k), E).sum(1).float()  # (b, E), before dropping
        for g in self.seq_groups:  # the whole sequence's counts
            ops.all_reduce(routed, g)
        f = routed / (s_full * k)
        P = probs.view(b, s, E).sum(1) / s_full  # this shard's part of the sequence mean
        balance = E * (f * P).sum()
        z = torch.logsumexp(logits, dim=-1).pow(2).sum()

        # permute: kept assignments (token-major index t·k + j) sorted by expert
        flat_e = top_i.reshape(-1)
        kept_idx = keep.nonzero().squeeze(1)
        e_kept = flat_e[kept_idx]
        order = torch.argsort(e_kept, stable=True)
        sel = kept_idx[order]
        counts = torch.bincount(e_kept, minlength=E)
        rows = flat[sel // k]
        if self.ep_group is not None and self.ep_group.size > 1:
            from ..parallel.expert import dispatch

            y = dispatch(rows, counts, self)
        else:
            y = self.compute_local(rows, counts.tolist())
        # un-permute into (N, k, h) slots (dropped ones stay 0) and weight in fixed k order
        slots = y.new_zeros(b * s * k, h).index_copy(0, sel, y)
        out = (slots.view(b * s, k, h) * weights.unsqueeze(-1).to(y.dtype)).sum(1)
        out = out.view(b, s, h).to(x.dtype)

        if not _in_backward():
            self.forwards += 1
            self.tokens_per_expert += counts.double()
            self.dropped += float(keep.numel() - kept_idx.numel())
            self.balance_sum += float(balance.detach())
            self.z_sum += float(z.detach())
        aux = cfg.aux_loss_coef * cfg.seq_len * balance + cfg.z_loss_coef * z
        if self.keep_aux:
            self.last_aux = aux
        if torch.is_grad_enabled() and aux.requires_grad:
            out = _AuxGrad.apply(out, aux, float(getattr(self.plan, "loss_scale", 1.0)))
        return out
