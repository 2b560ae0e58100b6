"""Grouped expert matmuls: a rank's SwiGLU experts as three grouped GEMMs over the rows sorted
by expert, instead of a Python loop of three matmuls per expert.

For the rank's E local experts with n_e rows each (the rows sorted by expert), X the (N, h)
rows and X_e its e-th block of rows, offs_e = n_0 + … + n_e (int32, the blocks' row ends), and
the weights stacked over the experts, W1, W3 ∈ (E, f, h) and W2 ∈ (E, h, f) (f = expert ffn):

    G_e = X_e W1_eᵀ    U_e = X_e W3_eᵀ    P_e = silu(G_e) ⊙ U_e    Y_e = P_e W2_eᵀ

Each product is one ``torch._grouped_mm(A, B, offs)`` — 2d × 3d: block e of A's rows times
B_e. Backward, given dY:

    dP_e  = dY_e W2_e                     (2d × 3d)
    dW2_e = dY_eᵀ P_e                     (2d × 2d with offs: the (E, h, f) stack of gradients)
    dG    = silu'(G) ⊙ U ⊙ dP    dU = silu(G) ⊙ dP        (``layers._SwiGLU``'s two kernels)
    dX_e  = dG_e W1_e + dU_e W3_e
    dW1_e = dG_eᵀ X_e              dW3_e = dU_eᵀ X_e

and each expert's gradient is returned for its own parameter (the views dW·[e] of the stacks),
so every ``experts.{e}.w1/w3/w2`` gets its ``.grad`` (zeros for an expert with no rows) and its
post-accumulate hooks (DDP/ZeRO buckets) fire, as with the loop. The parameter layout is
untouched: checkpoints, HF import/export, ep sharding and ZeRO see one tensor per expert
weight.

Saved for backward: X, G, U and P — exactly what the loop of ``moe.Expert`` modules saves
(each linear its input, X once for w1 and w3; ``_SwiGLU`` G and U; w2 its input P), so the
ledger's activation terms (``fived.ledger.memory``: ``mlp`` 3·e·f per routed row, the rows in
``router``) hold for both modes. The weights are not saved: ctx keeps the parameters
themselves (no bytes; ZeRO-3 has refilled them by the time this backward runs).

Memory trade-off. The grouped kernel needs each weight as one (E, ·, ·) tensor while the
parameters stay one tensor per expert, so forward stacks them: a transient copy of

    E_local · 3 · h · f  elements (the compute dtype) per MoE layer,

freed when the forward returns. Backward stacks them again rather than saving the stack from
forward, which would keep a second copy of every layer's expert weights alive as saved
activations (L · E_local · 3 · h · f) from each forward to its backward. The price is one more
copy of the weights per layer and backward (memory traffic, no FLOPs; on a CPU it is what
makes grouped the slower for wide experts with few rows each). The ledger counts the stack as
a transient buffer (``fived.ledger.memory.comm_buffers``: ``expert_stack``).

Where ``torch._grouped_mm`` cannot run (``grouped_supported``: the op missing, a dtype or
device its kernel lacks, h or f not a multiple of 16 bytes, fake tensors other than bf16 — the
op's meta function takes bf16 only), the same function runs each grouped product as a loop of
per-expert matmuls over the sorted rows (``_gmm``): the same formulas, saves and gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the CPU kernel's dtypes


def _is_fake(x: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(x)


def grouped_supported(x: torch.Tensor, hidden: int, ffn: int) -> bool:
    """Whether ``torch._grouped_mm`` runs on rows like ``x`` (its dtype and device) with
    experts of width ``hidden`` × ``ffn``: the op exists; every row stride is a multiple of 16
    bytes; the dtype is fp32/bf16/fp16 on a real CPU tensor, bf16 elsewhere (the CUDA fast path
    and the op's meta function, which fake tensors and the dry run use)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    size = x.element_size()
    if (hidden * size) % 16 or (ffn * size) % 16:
        return False
    if x.device.type == "cpu" and not _is_fake(x):
        return x.dtype in CPU_DTYPES
    return x.dtype == torch.bfloat16


def use_grouped(mode: str, x: torch.Tensor, hidden: int, ffn: int) -> bool:
    """``expert_matmul`` = ``mode`` (``config.EXPERT_MATMULS``) for rows ``x``: grouped (the
    kernel where it runs, else the per-expert fallback inside the same function), loop (the
    ``Expert`` modules), or auto: grouped where the kernel runs, else loop. On this CPU
    grouped is the faster at small widths (0.70–0.83× the loop's time at h 64, f 32, 8 to 128
    experts) and the slower for wide experts with few rows each (1.5× at h 256, f 512, 64
    rows per expert: the weight stacks); docs/expert-parallel.md, "Grouped expert matmuls"."""
    if mode == "loop":
        return False
    return mode == "grouped" or grouped_supported(x, hidden, ffn)


def _gmm(a: torch.Tensor, b: torch.Tensor, counts: Sequence[int], offs: torch.Tensor | None
         ) -> torch.Tensor:
    """Grouped product over row blocks of ``counts`` rows: 2d × 3d (a (N, k), b (E, k, n) ->
    (N, n), block e times b[e]) or 2d × 2d (a (m, N), b (N, n) -> (E, m, n), a's column block e
    times b's row block e). ``offs`` None: the per-expert loop."""
    if b.dim() == 3:
        if offs is not None:
            return torch._grouped_mm(a, b, offs=offs)
        if a.shape[0] == 0:
            return a.new_zeros(0, b.shape[-1])
        return torch.cat([blk @ w for blk, w in zip(torch.split(a, list(counts)), b)])
    if offs is not None and a.shape[1] > 0:  # the kernel refuses a 0-wide (m, 0) operand
        return torch._grouped_mm(a, b, offs=offs)
    if a.shape[1] == 0:
        return a.new_zeros(len(counts), a.shape[0], b.shape[1])
    return torch.stack([x @ y for x, y in zip(torch.split(a, list(counts), 1),
                                              torch.split(b, list(counts)))])


def _offsets(counts: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """offs_e = n_0 + … + n_e, int32 on the rows' device."""
    ends, run = [], 0
    for n in counts:
        run += int(n)
        ends.append(run)
    # made on the CPU and moved: under FakeTensorMode a tensor made on ``meta`` directly is a
    # real meta tensor, not a fake one (the dry run)
    return torch.tensor(ends, dtype=torch.int32).to(like.device)


class GroupedSwiGLU(torch.autograd.Function):
    """The rank's experts over rows sorted by expert (see the module docstring).

    ``apply(x, counts, kernel, params, *weights)``: ``counts`` the rows per local expert (ints),
    ``kernel`` whether ``torch._grouped_mm`` runs (else the per-expert loop), ``params`` the
    parameters w1_0 … w1_{E−1}, w3_0 …, w2_0 … (kept on ctx, not saved: no bytes, and ZeRO-3
    refills them before this backward), ``weights`` the same tensors as the inputs the
    gradients are returned to."""

    @staticmethod
    def forward(ctx, x, counts, kernel, params, *weights):
        x = x.contiguous()
        g, u, p, y = _forward(x, counts, kernel, _stacks(weights, len(counts)))
        ctx.counts, ctx.kernel, ctx.params = counts, kernel, params
        ctx.save_for_backward(x, g, u, p)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, g, u, p = ctx.saved_tensors
        counts = ctx.counts
        w1, w3, w2 = _stacks(ctx.params, len(counts))  # stacked again, not saved
        offs = _offsets(counts, x) if ctx.kernel else None
        dy = dy.contiguous()
        dp = _gmm(dy, w2, counts, offs)
        dw2 = _gmm(dy.t(), p, counts, offs)
        dg = torch.ops.aten.silu_backward(dp * u, g)  # ``layers._SwiGLU``'s backward
        du = dp * F.silu(g)
        dx = _gmm(dg, w1, counts, offs) + _gmm(du, w3, counts, offs)
        dw1 = _gmm(dg.t(), x, counts, offs)
        dw3 = _gmm(du.t(), x, counts, offs)
        return (dx, None, None, None, *dw1.unbind(0), *dw3.unbind(0), *dw2.unbind(0))


def _stacks(weights: Sequence[torch.Tensor], E: int) -> list[torch.Tensor]:
    """[w1_0 … w1_{E−1}, w3_0 …, w2_0 …] -> the three (E, ·, ·) stacks (copies)."""
    return [torch.stack(tuple(weights[i * E:(i + 1) * E])) for i in range(3)]


def _forward(x: torch.Tensor, counts: Sequence[int], kernel: bool,
             stacks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """G, U, P, Y of the module docstring."""
    w1, w3, w2 = stacks
    offs = _offsets(counts, x) if kernel else None
    g = _gmm(x, w1.transpose(1, 2), counts, offs)
    u = _gmm(x, w3.transpose(1, 2), counts, offs)
    p = F.silu(g) * u  # ``layers._SwiGLU``'s forward
    return g, u, p, _gmm(p, w2.transpose(1, 2), counts, offs)


def grouped_experts(rows: torch.Tensor, counts: Sequence[int], experts: Sequence[nn.Module],
                    kernel: bool | None = None) -> torch.Tensor:
    """``experts`` (``moe.Expert``: w1, w3, w2) over ``rows`` sorted by expert, ``counts[j]``
    rows for ``experts[j]`` -> their outputs in the same order, as one grouped operation;
    ``kernel``: run ``torch._grouped_mm`` (None: where ``grouped_supported``) or the fallback.

    Each weight enters through an alias (``view_as``) made in registration order (experts in
    order, w1, w3, w2 each): autograd runs the alias with the highest sequence number first,
    so the gradients reach the parameters — and their post-accumulate hooks, the DDP/ZeRO
    buckets — last registered first, the order the loop of modules gives and the engines lay
    their buckets out in (``fived.ledger.memory.buckets``), not the order in which one
    node's outputs happen to leave autograd's ready queue."""
    if not experts:
        return rows
    if kernel is None:
        w = experts[0].w1.weight
        kernel = grouped_supported(rows, w.shape[1], w.shape[0])
    alias = {}
    for ex in experts:  # registration order
        for lin in (ex.w1, ex.w3, ex.w2):
            alias[lin] = lin.weight.view_as(lin.weight)
    mods = ([ex.w1 for ex in experts] + [ex.w3 for ex in experts]
            + [ex.w2 for ex in experts])
    return GroupedSwiGLU.apply(rows, tuple(int(n) for n in counts), kernel,
                               [m.weight for m in mods], *(alias[m] for m in mods))
