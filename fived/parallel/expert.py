"""Expert parallelism: route rows to the ep rank that owns their expert, and back.

An ep group of n ranks splits the E experts into n contiguous blocks of E/n (rank r owns experts
r·E/n ... (r+1)·E/n − 1). Per MoE layer and micro-batch, on every rank:

1. the MoE layer has sorted its kept (token, choice) rows by destination expert and counted
   them per expert (``counts``, E integers);
2. the counts are exchanged (an even all-to-all of E int64: rank j gets the counts for its
   experts), so every rank knows how many rows it will receive from each source;
3. all-to-all of the rows (uneven splits) to the owners;
4. the owner regroups what it received by local expert, runs its experts, restores the order;
5. all-to-all back (splits swapped); the layer un-permutes and weights the rows.

Everything goes through ``fived.comm`` and is charged to the group name ``ep``. Bytes one rank
sends per MoE layer forward (ops.all_to_all counts rows sent to *other* ranks only):

    counts exchange   (E − E/n) · 8
    dispatch          S · h · b        S = rows this rank sends to experts it does not own
    combine           R · h · b        R = rows it receives from other ranks for its experts

and the backward repeats the two row all-to-alls with splits swapped (R·h·b then S·h·b), so

    ep bytes per rank = Σ_{layers, micro-batches} [ (E − E/n)·8 + 2·(S + R)·h·b ]

(full recompute runs the forward once more: (1+1)·counts + (2+1)·(S+R)·h·b). The ledger owns
the formulas: ``fived.ledger.traffic.ep_routed_bytes`` evaluates this exactly from the routing
the trainer records, ``ep_traffic`` is the balanced-routing expectation the planner uses, and
``fived.ledger.params.expert_param_bytes`` the expert parameters per rank:

    expert bytes = layers_on_rank · (E/n) · 3 · h · ffn_e · b        (replicated over tp)

Gradients: expert parameters are placed with ``grad_group = "expert"`` and reduced over the
``expert`` group (dp·cp) — the owner already holds the gradient of every ep rank's rows, which
came back through the all-to-all's backward; the router and every dense parameter reduce over
``dense`` (dp·ep·cp).

The token dispatch (``ep_dispatch = tokens``, ``dispatch_tokens``) sends each token once to each
ep rank it reaches (U rows) with its assignments' places and fp32 weights; the owner sums each
token's weighted expert outputs and sends one row back per (token, rank). Per rank and layer
forward, S_u / R_u token rows sent / received, S / R assignments:

    (n − 1)·(E/n + 1)·8 + S·12 + (S_u + R_u)·h·b,   backward (S_u + R_u)·h·b + R·4

(``ep_routed_bytes(..., sent_rows=...)``; ``ep_token_traffic`` at ``ep_destinations_bound``).

``apply_ep(model, group, placements, mode)`` removes the experts a rank does not own from each plain
MoE layer and hands the layer ``dispatch`` (or ``dispatch_tokens``) over its explicit ep group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import nn

from ..comm import autograd, ops
from ..model.moe import moe_layers
from .placement import Placement


def dispatch(rows: torch.Tensor, counts: torch.Tensor, compute: Callable, group: Any
             ) -> torch.Tensor:
    """Rows sorted by global expert (``counts`` per expert) -> the experts' outputs, same order;
    ``compute(rows, counts_per_local_expert)`` runs this rank's experts."""
    n = group.size
    per = counts.numel() // n
    recv = ops.all_to_all(counts.to(torch.int64).contiguous(), group).view(n, per)
    in_splits = counts.view(n, per).sum(1).tolist()
    out_splits = recv.sum(1).tolist()
    got = autograd.all_to_all(rows, group, in_splits, out_splits)  # source-major, then local expert
    # regroup by local expert: row of (source i, local expert j) -> expert-major order
    local_id = torch.repeat_interleave(torch.arange(per, device=rows.device).repeat(n),
                                       recv.reshape(-1))
    order = torch.argsort(local_id, stable=True)
    y = compute(got[order], recv.sum(0).tolist())
    y = y[torch.argsort(order)]  # back to source-major
    return autograd.all_to_all(y, group, out_splits, in_splits)


# ---------------------------------------------------------------------------- token dispatch

def token_plan(tok: torch.Tensor, counts: torch.Tensor, n: int, N: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int]]:
    """The data-dependent part of ``dispatch_tokens``: for the kept assignments (their tokens
    ``tok``, sorted by global expert, ``counts`` per expert) the distinct (ep rank, token) pairs
    sorted by rank then token — their tokens ``u_tok`` — each assignment's place among its
    rank's pairs (``pos``), the pairs per rank (a tensor), and the assignments and the pairs
    that go to each rank (lists)."""
    a_splits = counts.view(n, -1).sum(1)
    dest = torch.repeat_interleave(torch.arange(n, device=tok.device), a_splits)
    uniq, inv = torch.unique(dest * N + tok, sorted=True, return_inverse=True)
    u_dest = uniq // N
    u_splits = torch.bincount(u_dest, minlength=n)
    start = u_splits.cumsum(0) - u_splits
    return uniq - u_dest * N, inv - start[dest], u_splits, a_splits.tolist(), u_splits.tolist()


def _received(recv: torch.Tensor, a_in: list[int], u_in: list[int]) -> list[list[int]]:
    """The exchanged (n, E/n + 1) counts as ints (the dry run knows them without values)."""
    return recv.tolist()


class _WeightedSum(torch.autograd.Function):
    """z[r] = Σ_{a: row[a] = r} w_a · y_a (``rows`` output rows): the owner's share of each
    token's combine. Saves ``y``, ``w`` and ``row`` (autograd would also keep w·y's cast
    weights); backward runs the kernels autograd runs."""

    @staticmethod
    def forward(ctx, y, w, row, rows):
        ctx.save_for_backward(y, w, row)
        wy = y * w.unsqueeze(-1).to(y.dtype)
        return y.new_zeros(rows, y.shape[-1]).index_add_(0, row, wy)

    @staticmethod
    def backward(ctx, g):
        y, w, row = ctx.saved_tensors
        gy = g.index_select(0, row)
        dy = gy * w.unsqueeze(-1).to(y.dtype)
        dw = (gy * y).sum(-1).to(w.dtype)
        return dy, dw, None, None


class _SumRows(torch.autograd.Function):
    """out[r] = Σ_{i: index[i] = r} src[i] (``rows`` output rows). Saves ``index`` only —
    autograd's index_add also keeps ``src``, a (rows sent × h) copy."""

    @staticmethod
    def forward(ctx, src, index, rows):
        ctx.save_for_backward(index)
        return src.new_zeros(rows, src.shape[-1]).index_add_(0, index, src)

    @staticmethod
    def backward(ctx, g):
        (index,) = ctx.saved_tensors
        return g.index_select(0, index), None, None


def dispatch_tokens(x: torch.Tensor, tok: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                    compute: Callable, group: Any, plan: Callable = token_plan,
                    received: Callable = _received) -> tuple[torch.Tensor, list[int]]:
    """``ep_dispatch = tokens``: the routed output (N, h) of the tokens ``x`` (N, h), and the
    token rows sent to each ep rank (for the statistics).

    ``tok``, ``w``: the token and fp32 weight of each kept assignment, sorted by global expert
    (``counts`` per expert). Each token goes once to each ep rank that owns one of its experts
    (with its assignments' places and weights), the owner runs its experts on the expanded rows
    and sums each token's weighted outputs there, and one row per (token, rank) comes back,
    summed into the token. ``plan`` and ``received`` are ``token_plan`` and ``_received`` (the
    dry run passes static ones: fake tensors have no values)."""
    n, N = group.size, x.shape[0]
    per = counts.numel() // n
    dev = x.device
    u_tok, pos, u_counts, a_in, u_in = plan(tok, counts, n, N)
    head = torch.cat([counts.view(n, per), u_counts.view(n, 1)], 1).to(torch.int64)
    recv = ops.all_to_all(head.reshape(-1).contiguous(), group).view(n, per + 1)
    rc = received(recv, a_in, u_in)
    u_out = [r[per] for r in rc]
    a_src = [sum(r[:per]) for r in rc]  # assignments from each source
    got_x = autograd.all_to_all(x.index_select(0, u_tok), group, u_in, u_out)  # source-major
    got_pos = ops.all_to_all(pos.contiguous(), group, a_in, a_src)
    got_w = autograd.all_to_all(w, group, a_in, a_src)
    # each received assignment's row of got_x (its source's block start + its place), then
    # the assignments regrouped by local expert
    total = sum(a_src)
    ru = recv[:, per]
    src = torch.repeat_interleave(torch.arange(n, device=dev), recv[:, :per].sum(1),
                                  output_size=total)
    local_id = torch.repeat_interleave(torch.arange(per, device=dev).repeat(n),
                                       recv[:, :per].reshape(-1), output_size=total)
    order = torch.argsort(local_id, stable=True)
    row = ((ru.cumsum(0) - ru)[src] + got_pos)[order]
    y = compute(got_x.index_select(0, row), [sum(r[j] for r in rc) for j in range(per)])
    z = _WeightedSum.apply(y, got_w[order], row, got_x.shape[0])
    back = autograd.all_to_all(z, group, u_out, u_in)
    return _SumRows.apply(back, u_tok, N), u_in


def apply_ep(model: nn.Module, group: Any, placements: dict[str, Placement],
             mode: str = "rows") -> nn.Module:
    """Keep this ep rank's E/ep contiguous experts in every MoE layer and dispatch to the owners
    (``mode`` = ep_dispatch: ``dispatch``, one row per assignment, or ``dispatch_tokens``).

    With any ep (1 included) the routed experts' gradients reduce over ``expert`` (dp·cp)."""
    names_of = {id(m): n for n, m in model.named_modules()}  # a trunk or an MTP block's MoE
    for moe in moe_layers(model):
        E = moe.cfg.experts
        per = E // group.size
        mine = range(group.rank * per, (group.rank + 1) * per)
        prefix = f"{names_of[id(moe)]}.experts."
        for e in list(moe.experts):
            names = [prefix + n for n, _ in moe.experts[e].named_parameters(prefix=e)]
            if int(e) in mine:
                for n in names:
                    placements[n] = replace(placements[n], grad_group="expert")
            else:
                del moe.experts[e]
                for n in names:
                    del placements[n]
        if group.size > 1 and mode == "tokens":
            moe.dispatch_tokens = partial(dispatch_tokens, group=group)
        elif group.size > 1:
            moe.dispatch = partial(dispatch, group=group)
    return model


# ---------------------------------------------------------------------------- statistics

def collect_stats(model: torch.nn.Module, cfg: Any, par: Any, placements: dict[str, Placement],
                  world_group: Any, global_tokens: int, step_seconds: float, traffic: Any
                  ) -> dict[str, Any]:
    """This step's MoE statistics over the whole world (one metrics all-gather), then reset.

    Returns ``tokens_per_expert`` (layers × experts, kept rows), ``dropped`` (assignments),
    ``aux_loss`` and ``z_loss`` (with their coefficients, summed over layers), ``balance``
    (mean B_q per layer: 1.0 is perfectly balanced), ``a2a_seconds`` (max over ranks),
    ``a2a_share`` (mean over ranks of all-to-all seconds / step seconds), and per rank:
    ``expert_param_bytes``, ``forwards`` and ``counts`` (the routing, for the exact ledger);
    with ``ep_dispatch = tokens`` also ``sent_rows`` (rank × layer × ep rank: the token rows
    the layer sent to each member of its ep group, over the step's micro-batches)."""
    Lyr, E = cfg.layers + cfg.mtp_depth, cfg.experts  # an MTP block's MoE: layer L + k
    head = 6
    n = par.ep if par.ep > 1 and par.ep_dispatch == "tokens" else 0  # rows per (layer, ep rank)
    row = torch.zeros(head + Lyr * E + Lyr * n, dtype=torch.float64)
    tail = head + Lyr * E
    layers = moe_layers(model)
    row[0] = float(sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if placements[n].grad_group == "expert"))
    ep_sec = traffic.seconds_by_dim().get("ep", 0.0)
    row[1] = ep_sec
    row[2] = ep_sec / step_seconds if step_seconds > 0 else 0.0
    for m in layers:
        st = m.stats
        row[3] += st.balance_sum
        row[4] += st.z_sum
        row[5] += st.dropped
        row[head + m.layer * E: head + (m.layer + 1) * E] += st.tokens_per_expert
        if n and st.sent_rows is not None:
            row[tail + m.layer * n: tail + (m.layer + 1) * n] += st.sent_rows
    fwd = float(sum(m.stats.forwards for m in layers))
    for m in layers:
        m.reset_stats()
    dev = next(model.parameters()).device  # nccl gathers cuda tensors
    vec = torch.cat([row, torch.tensor([fwd], dtype=torch.float64)]).to(dev)
    world = world_group.size
    allrows = torch.zeros(world * vec.numel(), dtype=torch.float64, device=dev)
    ops.all_gather_into(allrows, vec, world_group)
    rows = allrows.view(world, -1).cpu()
    # without SP every tp rank routes the same tokens: count each token once
    copies = 1 if (par.sequence_parallel and par.tp > 1) else par.tp
    tot = rows.sum(0) / copies
    global_seqs = global_tokens / cfg.seq_len
    counts = tot[head:head + Lyr * E].view(Lyr, E)
    extra = {"sent_rows": [[[int(v) for v in layer] for layer in r[tail:tail + Lyr * n]
                            .view(Lyr, n).tolist()] for r in rows]} if n else {}
    return extra | {
        "tokens_per_expert": [[int(round(v)) for v in r] for r in counts.tolist()],
        "dropped": int(round(float(tot[5]))),
        "aux_loss": cfg.aux_loss_coef * float(tot[3]) / global_seqs,
        "z_loss": cfg.z_loss_coef * float(tot[4]) / global_tokens,
        "balance": float(tot[3]) / global_seqs / max(cfg.moe_layers + cfg.mtp_depth, 1),
        "a2a_seconds": float(rows[:, 1].max()),
        "a2a_share": float(rows[:, 2].mean()),
        "expert_param_bytes": [int(v) for v in rows[:, 0].tolist()],
        "forwards": [int(v) for v in rows[:, -1].tolist()],
        "counts": [r[head:head + Lyr * E].view(Lyr, E).tolist() for r in rows],
    }

