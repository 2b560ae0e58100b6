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

(full recompute runs the forward once more: (1+1)·counts + (2+1)·(S+R)·h·b;
``a2a_bytes`` evaluates it exactly from the measured routing; ``a2a_bytes_uniform`` is the
balanced-routing estimate the ledger can use without data). Expert parameters per rank:

    expert bytes = layers_on_rank · (E/n) · 3 · h · ffn_e · b        (replicated over tp)

Gradients: expert parameters carry ``_fived_expert`` and are reduced over the ``expert`` group
(dp·cp) — the owner already holds the gradient of every ep rank's rows, which came back through
the all-to-all's backward; the router and every dense parameter reduce over ``dense`` (dp·ep·cp).
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import autograd as A
from ..comm import ops

COUNT_BYTES = 8  # the counts are exchanged as int64


def dispatch(rows: torch.Tensor, counts: torch.Tensor, moe: Any) -> torch.Tensor:
    """Rows sorted by global expert (``counts`` per expert) -> the experts' outputs, same order."""
    group = moe.ep_group
    n = group.size
    per = counts.numel() // n
    recv = ops.all_to_all(counts.to(torch.int64).contiguous(), group).view(n, per)
    in_splits = counts.view(n, per).sum(1).tolist()
    out_splits = recv.sum(1).tolist()
    got = A.all_to_all(rows, group, in_splits, out_splits)  # source-major, then local expert
    # regroup by local expert: row of (source i, local expert j) -> expert-major order
    local_id = torch.repeat_interleave(torch.arange(per).repeat(n), recv.reshape(-1))
    order = torch.argsort(local_id, stable=True)
    y = moe.compute_local(got[order], recv.sum(0).tolist())
    y = y[torch.argsort(order)]  # back to source-major
    return A.all_to_all(y, group, out_splits, in_splits)


# ---------------------------------------------------------------------------- formulas

def expert_param_bytes(cfg: Any, ep: int, layers_on_rank: int | None = None,
                       dtype_bytes: int = 4) -> int:
    """Bytes of expert weights one rank holds: layers · (E/ep) · 3 · h · ffn_e · b."""
    layers = cfg.layers if layers_on_rank is None else layers_on_rank
    return layers * (cfg.experts // ep) * 3 * cfg.hidden * cfg.expert_ffn * dtype_bytes


def a2a_bytes(counts: list[list[list[float]]], ep_groups: list[tuple[int, ...]], cfg: Any,
              forwards: list[int], dtype_bytes: int = 4, recompute_full: bool = False
              ) -> list[float]:
    """Exact ep bytes each rank sends in one step, from the routing.

    ``counts[r][l][e]``: rows rank r routed to expert e in layer l (summed over micro-batches);
    ``ep_groups``: the ep groups (member ranks in ep order); ``forwards[r]``: MoE layer forwards
    rank r ran (layers held × micro-batches), each with one counts exchange. With full
    recompute the forward (counts and both row all-to-alls) runs once more inside backward.
    """
    again = 1 if recompute_full else 0
    E = cfg.experts
    out = [0.0] * len(counts)
    for members in ep_groups:
        n = len(members)
        if n == 1:
            continue
        per = E // n
        for i, r in enumerate(members):
            mine = range(i * per, (i + 1) * per)
            sent = recv = 0.0
            for layer in range(len(counts[r])):
                sent += sum(c for e, c in enumerate(counts[r][layer]) if e not in mine)
                recv += sum(counts[q][layer][e] for q in members if q != r for e in mine)
            out[r] = ((1 + again) * forwards[r] * (E - per) * COUNT_BYTES
                      + (2 + again) * (sent + recv) * cfg.hidden * dtype_bytes)
    return out


def a2a_bytes_uniform(cfg: Any, ep: int, tokens_per_rank: float, layers_on_rank: int,
                      micro_batches: int = 1, dtype_bytes: int = 4) -> float:
    """ep bytes per rank per step when routing is perfectly balanced and nothing is dropped:
    each layer sends and receives tokens·k·(ep−1)/ep rows, forward and backward."""
    if ep <= 1:
        return 0.0
    rows = tokens_per_rank * cfg.top_k * (ep - 1) / ep
    counts = layers_on_rank * micro_batches * (cfg.experts - cfg.experts // ep) * COUNT_BYTES
    return counts + layers_on_rank * 2 * 2 * rows * cfg.hidden * dtype_bytes


# ---------------------------------------------------------------------------- statistics

def moe_layers(model: torch.nn.Module) -> list[Any]:
    from ..model.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


def collect_stats(model: torch.nn.Module, cfg: Any, par: Any, grid: Any, world_group: Any,
                  global_tokens: int, step_seconds: float, traffic: Any) -> dict[str, Any]:
    """This step's MoE statistics over the whole world (one metrics all-gather), then reset.

    Returns ``tokens_per_expert`` (layers × experts, kept rows), ``dropped`` (assignments),
    ``aux_loss`` and ``z_loss`` (with their coefficients, summed over layers), ``balance``
    (mean B_q per layer: 1.0 is perfectly balanced), ``a2a_seconds`` (max over ranks),
    ``a2a_share`` (mean over ranks of all-to-all seconds / step seconds), and per rank:
    ``expert_param_bytes``, ``forwards`` and ``counts`` (the routing, for the exact ledger)."""
    Lyr, E = cfg.layers, cfg.experts
    head = 6
    row = torch.zeros(head + Lyr * E, dtype=torch.float64)
    layers = moe_layers(model)
    row[0] = float(sum(p.numel() * p.element_size() for p in model.parameters()
                       if getattr(p, "_fived_expert", False)))
    ep_sec = traffic.seconds_by_dim().get("ep", 0.0)
    row[1] = ep_sec
    row[2] = ep_sec / step_seconds if step_seconds > 0 else 0.0
    for m in layers:
        row[3] += m.balance_sum
        row[4] += m.z_sum
        row[5] += m.dropped
        row[head + m.layer * E: head + (m.layer + 1) * E] += m.tokens_per_expert
    fwd = float(sum(m.forwards for m in layers))
    for m in layers:
        m.reset_stats()
    vec = torch.cat([row, torch.tensor([fwd], dtype=torch.float64)])
    world = world_group.size
    allrows = torch.zeros(world * vec.numel(), dtype=torch.float64)
    ops.all_gather_into(allrows, vec, world_group)
    rows = allrows.view(world, -1)
    # without SP every tp rank routes the same tokens: count each token once
    copies = 1 if (par.sequence_parallel and par.tp > 1) else par.tp
    tot = rows.sum(0) / copies
    global_seqs = global_tokens / cfg.seq_len
    counts = tot[head:head + Lyr * E].view(Lyr, E)
    return {
        "tokens_per_expert": [[int(round(v)) for v in r] for r in counts.tolist()],
        "dropped": int(round(float(tot[5]))),
        "aux_loss": cfg.aux_loss_coef * float(tot[3]) / global_seqs,
        "z_loss": cfg.z_loss_coef * float(tot[4]) / global_tokens,
        "balance": float(tot[3]) / global_seqs / max(Lyr, 1),
        "a2a_seconds": float(rows[:, 1].max()),
        "a2a_share": float(rows[:, 2].mean()),
        "expert_param_bytes": [int(v) for v in rows[:, 0].tolist()],
        "forwards": [int(v) for v in rows[:, -1].tolist()],
        "counts": [r[head:head + Lyr * E].view(Lyr, E).tolist() for r in rows],
    }
