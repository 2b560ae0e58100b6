"""Context parallelism: the sequence cut across the ``cp`` group — zigzag sharding, ring attention
(Liu et al. 2023, "Ring Attention with Blockwise Transformers") and Ulysses (Jacobs et al. 2023,
"DeepSpeed Ulysses").

Sequence sharding (``shard_batch``)
    The sequence of length S is cut into 2·cp chunks of c = S/(2·cp) tokens; cp rank i holds
    chunks i and 2·cp−1−i (zigzag, "head-tail"), so every rank holds the same amount of causal
    attention work. RoPE positions follow the shard. Each rank computes Σ CE over its own tokens;
    the trainer sums the loss and the engine the gradients over ``dense`` (which holds cp).

Ring attention (``--cp-mode ring``)
    K/V blocks (the kv heads, never repeated to the query heads) travel around the cp ring with
    ``fived.comm.ops.exchange``; the transfer of the next block is posted before the current
    block's attention runs. Partial results merge by log-sum-exp:

        lse = logaddexp(lse₁, lse₂),   o = o₁·exp(lse₁ − lse) + o₂·exp(lse₂ − lse)

    Causal masking is decided per chunk pair: a K/V chunk after the query chunk is skipped, one
    before it is attended unmasked, the same chunk is causal. With zigzag, step 0 costs 3 chunk
    pairs and every other step exactly 2 on every rank. The backward recomputes the block
    probabilities from the saved q, local K/V, output and lse, accumulates dQ locally, rotates
    K/V around the ring again and sends the dK/dV accumulators along so that they arrive at
    their owner after cp−1 hops.

    Bytes one rank sends per layer (B = b·(S/cp)·kv_heads·d·bytes, one of K or V):
        forward  (cp−1)·2B          (K/V)
        backward (cp−1)·2B + (cp−1)·2B   (K/V again, and dK/dV)

MLA's latent ring (``--cp-mode ring-latent``, ``LatentRing``)
    The ring's loops (``_ring_forward``, ``_ring_backward``) with the latent on the ring: each
    rank sends its block's [c ; kᴿ] (b, S/cp, r_kv + d_r), fp32, and up-projects every block
    it holds through its W_kvb (H/tp heads):

        [kᴺ_h ; v_h] = W_kvb,h · c,   k_h = [kᴺ_h ; kᴿ],   v_h padded to d_q for the kernel

    Backward re-expands each block, sends dlatent home in the accumulator and adds W_kvb's
    gradient of every block locally, with D = [dkᴺ dv] of the block (b·s, H·(d_n + d_v)):

        dc = D · W_kvb,   dkᴿ = Σ_h dk_h[d_n:],   dW_kvb += Dᵀ · c

    It saves q and the local latent (fp32), the d_v output and the lse. Bytes one rank sends per
    layer (L = b·(S/cp)·(r_kv + d_r)·4): forward (cp−1)·L, backward (cp−1)·L + (cp−1)·L.

Ulysses (``--cp-mode ulysses``)
    Four all-to-alls per layer and direction: q, k, v from sequence-sharded to head-sharded
    (each rank gets the full sequence for heads/cp of its heads), attention, and the output back.
    Needs (heads/tp) % cp == 0 (``ConfigError`` otherwise). KV heads: when kv_heads/tp < cp, each
    kv head is *replicated* (cp/kv_heads_local times) before the all-to-all so every rank
    receives the kv head its query heads read; when neither divides the other, kv heads are
    repeated to the query heads. Bytes per layer and direction: (cp−1)/cp of q, k', v', out,
    with k', v' the (replicated) local kv tensors.

The third mode, ``allgather`` (bench only), all-gathers K/V (backward: reduce-scatter of dK/dV)
and is the baseline the bench compares against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..comm import autograd as comm_autograd
from ..comm import ops
from ..config import ConfigError
from ..ledger.context import (  # noqa: F401 - the torch-free formulas, re-exported
    LAYOUTS,
    activation_bytes,
    attention_flops,
    chunk_ids,
    step_plan,
    traffic_per_layer,
    ulysses_kv_heads,
)
from ..ledger.context import positions as cp_positions
from ..model import layers
from ..model.documents import doc_mask
from ..model.layers import doc_attention
from ..model.moe import moe_layers
from ..model.mtp import inside_of, mtp_blocks
from .counts import add_count_reduction
from .cp_balance import (  # noqa: F401 - balanced_positions, ptrr_chunks re-exported
    BALANCERS,
    PTRR_CHUNKS,
    balanced_positions,
    ptrr_chunks,
    rank_chunks,
)


# ---------------------------------------------------------------------------------- sharding
def shard_positions(seq_len: int, n: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """Global token positions held by cp rank ``rank`` (S/n of them, in local order;
    ``fived.ledger.context.positions``)."""
    if seq_len % (2 * n):
        raise ConfigError([f"seq_len {seq_len} is not divisible by 2·cp = {2 * n} (zigzag)"])
    return torch.tensor(cp_positions(seq_len, n, rank, layout), dtype=torch.int64)


def shard_batch(x: torch.Tensor, y: torch.Tensor, grid: Any, layout: str = "zigzag"
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This cp rank's shard of (tokens, targets) along the sequence, and its RoPE positions."""
    cp = grid["cp"]
    pos = shard_positions(x.shape[1], cp.size, cp.rank, layout)
    return x[:, pos].contiguous(), y[:, pos].contiguous(), pos


# ---------------------------------------------------------------------------------- statistics
@dataclass
class AttentionStats:
    """FLOPs the ring attention kernels executed (for the balance measurement). Pass one as
    ``ring_attention(..., stats=s)``: the forward adds its blocks, and the backward (which runs
    later, through autograd) adds its own to the same object."""

    flops: float = 0.0
    pairs: int = 0

    def reset(self) -> None:
        self.flops, self.pairs = 0.0, 0

    def count(self, q: torch.Tensor, k: torch.Tensor, pairs: int) -> None:
        b, g, rep, sq, d = q.shape  # 2 matmuls (q kᵀ and p v), 2 FLOPs per multiply-add
        self.flops += 4.0 * b * g * rep * sq * k.shape[2] * d
        self.pairs += pairs


# ---------------------------------------------------------------------------------- block kernels
# Internal layouts: q, o (b, g, rep, s, d) — query head h = g_index·rep + rep_index, matching
# repeat_interleave in ``causal_attention``; k, v (b, g, s, d); lse (b, g, rep, s) in fp32.
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention
_EFFICIENT_BWD = torch.ops.aten._scaled_dot_product_efficient_attention_backward


def _fused(q: torch.Tensor, fused: bool) -> bool:
    """A fused kernel for blocks when asked for: the CPU flash kernel on the CPU in fp32, the
    memory-efficient kernel (fp32, with its log-sum-exp) on a GPU and on the dry run's meta
    device; else the explicit math, which materialises each block's fp32 scores."""
    if not fused:
        return False
    if q.device.type == "cpu":
        return _FLASH is not None and q.dtype == torch.float32
    return q.device.type in ("cuda", "meta")


def _kernel_forward(qh, kh, vh, causal, scale):
    """(o, lse) of (b, h, s, d) blocks from the device's fused kernel; lse (b, h, sq) fp32."""
    if qh.device.type == "cpu":
        return _FLASH(qh, kh, vh, 0.0, causal, scale=scale)
    o, lse, _, _ = _EFFICIENT(qh, kh, vh, None, True, 0.0, causal, scale=scale)
    return o, lse[..., :qh.shape[-2]]  # the kernel pads its lse rows to a multiple of 32


def _kernel_backward(do, qh, kh, vh, o, lse, causal, scale):
    """(dq, dk, dv) of (b, h, s, d) blocks from the device's fused kernel, given the merged
    output and log-sum-exp of the whole row."""
    if qh.device.type == "cpu":
        return _FLASH_BWD(do, qh, kh, vh, o, lse, 0.0, causal, scale=scale)
    rows = qh.shape[-2]
    padded = torch.nn.functional.pad(lse, (0, -rows % 32))
    seed = torch.zeros((), dtype=torch.int64, device=qh.device)
    dq, dk, dv, _ = _EFFICIENT_BWD(do, qh, kh, vh, None, o, padded, seed, seed, 0.0,
                                   [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()


def _scores(q, k, causal, scale):
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~_causal_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    return s


def _heads(q: torch.Tensor, k: torch.Tensor):
    """(b, g, rep, s, d) q and (b, g, s, d) k → (b, h, s, d) each, kv repeated for the kernel."""
    b, g, rep, s, d = q.shape
    qh = q.reshape(b, g * rep, s, d)
    kh = k.repeat_interleave(rep, dim=1) if rep > 1 else k
    return qh, kh


def _block_forward(q, k, v, causal, scale, fused):
    """One block: (o, lse) of q (b, g, rep, sq, d) against k, v (b, g, sk, d)."""
    if _fused(q, fused):
        b, g, rep, sq, d = q.shape
        qh, kh = _heads(q, k)
        vh = v.repeat_interleave(rep, dim=1) if rep > 1 else v
        o, lse = _kernel_forward(qh, kh, vh, causal, scale)
        return o.reshape(b, g, rep, sq, d), lse.reshape(b, g, rep, sq).float()
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p, v.unsqueeze(2)), lse


def _grads_of_probs(p, q, k, v, do, delta, scale):
    """(dq, dk, dv) of one block from its probabilities ``p`` (the row's merged lse applied)
    and ``delta`` = rowsum(do · o): the attention backward on the math path."""
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)
    dp = torch.matmul(do, v.unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(2) * scale
    return dq, dk, dv


def _block_backward(q, k, v, causal, lse, do, o, delta, scale, fused):
    """One block's (dq, dk, dv), with the *merged* output ``o`` and ``lse`` of the whole row."""
    if _fused(q, fused):
        b, g, rep, sq, d = q.shape
        qh, kh = _heads(q, k)
        vh = v.repeat_interleave(rep, dim=1) if rep > 1 else v
        dqh, dkh, dvh = _kernel_backward(
            do.reshape(b, g * rep, sq, d), qh, kh, vh, o.reshape(b, g * rep, sq, d),
            lse.reshape(b, g * rep, sq), causal, scale)
        sk = k.shape[2]
        return (dqh.reshape(b, g, rep, sq, d), dkh.reshape(b, g, rep, sk, d).sum(2),
                dvh.reshape(b, g, rep, sk, d).sum(2))
    p = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))
    return _grads_of_probs(p, q, k, v, do, delta, scale)


def _merge(o_acc, lse_acc, o, lse, rows: slice) -> None:
    """In place: rows of (o_acc, lse_acc) ← log-sum-exp merge with the partial (o, lse)."""
    old_o, old_lse = o_acc[..., rows, :], lse_acc[..., rows]
    new = torch.logaddexp(old_lse, lse)
    o_acc[..., rows, :] = old_o * torch.exp(old_lse - new).unsqueeze(-1) + o * torch.exp(
        lse - new).unsqueeze(-1)
    lse_acc[..., rows] = new


def _merge_safe(o_acc, lse_acc, o, lse, rows: slice) -> None:
    """``_merge`` for document masks, where a row may have seen no key yet (lse −inf on both
    sides): its weights are 0, not NaN."""
    old_o, old_lse = o_acc[..., rows, :], lse_acc[..., rows]
    new = torch.logaddexp(old_lse, lse)
    ref = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    o_acc[..., rows, :] = old_o * torch.exp(old_lse - ref).unsqueeze(-1) + o * torch.exp(
        lse - ref).unsqueeze(-1)
    lse_acc[..., rows] = new


def _masked_forward(q, k, v, mask, scale):
    """One block under a document mask (b, sq, sk): (o, lse); a row with no visible key in the
    block gets o = 0 and lse = −inf (it merges as nothing)."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    s = s.masked_fill(~mask[:, None, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    ref = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - ref.unsqueeze(-1))
    return torch.matmul(p, v.unsqueeze(2)), lse


def _masked_backward(q, k, v, mask, lse, do, delta, scale):
    """One block's (dq, dk, dv) under a document mask, with the merged row ``lse`` (finite:
    every token sees itself)."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    s = s.masked_fill(~mask[:, None, None], float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    return _grads_of_probs(p, q, k, v, do, delta, scale)


def doc_plan(q_chunks: torch.Tensor, kv_chunks: torch.Tensor, c: int, docs: torch.Tensor
             ) -> list[tuple[slice, int, torch.Tensor]]:
    """The chunk pairs of the local q chunks against one K/V block that document masks leave
    anything in: (q rows, kv local chunk index, mask (b, c, c)). ``q_chunks``/``kv_chunks``:
    (b, k) global chunk ids of the two ranks' local chunks, per row (zigzag: the same for
    every row; ``ptrr``: each row's own). A pair is skipped — never computed — when, in every
    row, its K/V chunk is later than the query chunk or wholly in other documents.
    ``docs``: the ids of the whole rows (b, S)."""
    out = []
    ar = torch.arange(c, device=docs.device)
    for a in range(q_chunks.shape[1]):
        qpos = q_chunks[:, a, None] * c + ar  # (b, c) global positions
        qd = docs.gather(1, qpos)
        for j in range(kv_chunks.shape[1]):
            kpos = kv_chunks[:, j, None] * c + ar
            live = kv_chunks[:, j] <= q_chunks[:, a]
            if not bool(live.any()):
                continue
            kd = docs.gather(1, kpos)
            # documents are contiguous: two chunks share one iff their id ranges overlap
            live &= (qd[:, 0] <= kd[:, -1]) & (qd[:, -1] >= kd[:, 0])
            if not bool(live.any()):
                continue
            mask = ((qd[:, :, None] == kd[:, None, :]) & (qpos[:, :, None] >= kpos[:, None, :])
                    & live[:, None, None])
            out.append((slice(a * c, (a + 1) * c), j, mask))
    return out


def _kv_rows(t: torch.Tensor, js: list[int], c: int) -> torch.Tensor:
    """Rows of the K/V chunks ``js`` of a (…, 2c, d) tensor (a view when they are contiguous)."""
    if js == [0, 1]:
        return t
    if len(js) == 1:
        return t[..., js[0] * c:(js[0] + 1) * c, :]
    return torch.cat([t[..., j * c:(j + 1) * c, :] for j in js], dim=-2)


def _to_inner_q(x: torch.Tensor, g: int) -> torch.Tensor:
    b, s, h, d = x.shape
    return x.float().permute(0, 2, 1, 3).reshape(b, g, h // g, s, d)


def _from_inner_q(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    b, g, rep, s, d = x.shape
    return x.reshape(b, g * rep, s, d).transpose(1, 2).to(dtype).contiguous()


def _ring_forward(qi, block, kv_of, group, layout, stats, fused, docs, owned, scale):
    """The ring's forward loop: (o, lse) of the local queries ``qi`` (b, g, rep, s, d) against
    every rank's block. ``block`` is what travels (this rank's), ``kv_of(block)`` its K/V
    (2, b, g, s, d): the block itself for the K/V ring, its up-projection for the latent one."""
    n, r = group.size, group.rank
    s = qi.shape[-2]
    c = s // 2
    o_acc = torch.zeros_like(qi)
    lse_acc = torch.full(qi.shape[:-1], float("-inf"), dtype=torch.float32, device=qi.device)
    q_chunks = chunk_ids(r, n, layout)
    cd = c if docs is None else s // owned.shape[2]  # the doc path's chunk length
    cur = block
    for t in range(n):
        handle, nxt = None, None
        if t < n - 1:  # post the next transfer before this block's attention
            nxt = torch.empty_like(cur)
            handle = ops.exchange(group, [(cur, (r + 1) % n)], [(nxt, (r - 1) % n)],
                                  async_op=True)
        src = (r - t) % n
        kv = kv_of(cur)
        if docs is not None:  # document masks: the pairs they leave, masked
            for rows, j, mask in doc_plan(owned[:, r], owned[:, src], cd, docs):
                kk, vv = _kv_rows(kv[0], [j], cd), _kv_rows(kv[1], [j], cd)
                o, lse = _masked_forward(qi[..., rows, :], kk, vv, mask, scale)
                if stats is not None:
                    stats.count(qi[..., rows, :], kk, 1)
                _merge_safe(o_acc, lse_acc, o, lse, rows)
        for rows, js, causal, pairs in ([] if docs is not None else
                                        step_plan(q_chunks, chunk_ids(src, n, layout), c)):
            kk, vv = _kv_rows(kv[0], js, c), _kv_rows(kv[1], js, c)
            o, lse = _block_forward(qi[..., rows, :], kk, vv, causal, scale, fused)
            if stats is not None:
                stats.count(qi[..., rows, :], kk, pairs)
            _merge(o_acc, lse_acc, o, lse, rows)
        if handle is not None:
            handle.wait()
            cur = nxt
    return o_acc, lse_acc


def _ring_backward(qi, block, kv_of, grad_of, doi, oi, lse, group, layout, stats, fused, docs,
                   owned, scale):
    """The ring's backward loop: (dq, d block) — dq of the local queries, and the gradient of
    this rank's travelling ``block``. Each step recomputes the received block's K/V
    (``kv_of``), accumulates its dK/dV, turns them into the block's gradient (``grad_of(dkv,
    block)``: dK/dV themselves for the K/V ring, dlatent for the latent one) and adds that to
    the accumulator that travels with the ring home to the block's owner."""
    n, r = group.size, group.rank
    c = qi.shape[-2] // 2
    delta = (None if _fused(qi, fused) and docs is None  # the fused kernel forms its own
             else (doi * oi).sum(-1))
    dq = torch.zeros_like(qi)
    own = None
    q_chunks = chunk_ids(r, n, layout)
    cur, acc = block, None  # acc: the travelling gradient accumulator of block (r − t)
    for t in range(n):
        sends, recvs, nxt, acc_in = [], [], None, None
        # one message per step: the block for step t+1, and (t ≥ 2) the accumulator of t−1
        if t < n - 1 and acc is not None and t >= 2:
            msg = torch.cat([cur, acc])
            buf = torch.empty_like(msg)
            sends, recvs = [(msg, (r + 1) % n)], [(buf, (r - 1) % n)]
        elif t < n - 1:
            buf = torch.empty_like(cur)
            sends, recvs = [(cur, (r + 1) % n)], [(buf, (r - 1) % n)]
        elif t >= 2:
            buf = torch.empty_like(acc)
            sends, recvs = [(acc, (r + 1) % n)], [(buf, (r - 1) % n)]
        handle = ops.exchange(group, sends, recvs, async_op=True) if sends else None
        src = (r - t) % n
        kv = kv_of(cur)
        contrib = torch.zeros_like(kv)
        if docs is not None:
            cd = qi.shape[-2] // owned.shape[2]
            for rows, j, mask in doc_plan(owned[:, r], owned[:, src], cd, docs):
                kk, vv = _kv_rows(kv[0], [j], cd), _kv_rows(kv[1], [j], cd)
                dqb, dkb, dvb = _masked_backward(qi[..., rows, :], kk, vv, mask,
                                                 lse[..., rows], doi[..., rows, :],
                                                 delta[..., rows], scale)
                if stats is not None:
                    stats.count(qi[..., rows, :], kk, 2)
                dq[..., rows, :] += dqb
                contrib[0][..., j * cd:(j + 1) * cd, :] += dkb
                contrib[1][..., j * cd:(j + 1) * cd, :] += dvb
        for rows, js, causal, pairs in ([] if docs is not None else
                                        step_plan(q_chunks, chunk_ids(src, n, layout), c)):
            kk, vv = _kv_rows(kv[0], js, c), _kv_rows(kv[1], js, c)
            dqb, dkb, dvb = _block_backward(qi[..., rows, :], kk, vv, causal, lse[..., rows],
                                            doi[..., rows, :], oi[..., rows, :],
                                            None if delta is None else delta[..., rows],
                                            scale, fused)
            if stats is not None:
                stats.count(qi[..., rows, :], kk, 2 * pairs)
            dq[..., rows, :] += dqb
            for dst, part in ((contrib[0], dkb), (contrib[1], dvb)):
                if js == [0, 1]:
                    dst += part
                else:
                    for i, j in enumerate(js):
                        dst[..., j * c:(j + 1) * c, :] += part[..., i * c:(i + 1) * c, :]
        # the step's last block gradients are summed in: not kept through the next step
        dqb = dkb = dvb = part = None
        grad = grad_of(contrib, cur)
        if handle is not None:
            handle.wait()
            if t < n - 1 and t >= 2:
                nxt, acc_in = buf[:cur.shape[0]], buf[cur.shape[0]:]
            elif t < n - 1:
                nxt = buf
            else:
                acc_in = buf
        if t == 0:
            own = grad
        else:
            acc = grad if acc_in is None else grad + acc_in
        if nxt is not None:
            cur = nxt
    if n > 1:  # the last accumulator belongs to rank r+1: one more hop home
        home = torch.empty_like(acc)
        ops.exchange(group, [(acc, (r + 1) % n)], [(home, (r - 1) % n)])
        own += home
    return dq, own


def _same(x, *_):
    return x


class RingAttention(torch.autograd.Function):
    """Causal attention over the cp-sharded sequence; q (b, s, h, d), k/v (b, s, g, d) local."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, stats, fused, docs=None, balance="zigzag"):
        n = group.size
        d = q.shape[-1]
        g = k.shape[2]
        scale = 1.0 / math.sqrt(d)
        qi = _to_inner_q(q, g)
        kv = torch.stack([k.float().transpose(1, 2), v.float().transpose(1, 2)]).contiguous()
        owned = None if docs is None else rank_chunks(docs, n, layout, balance)
        o_acc, lse_acc = _ring_forward(qi, kv, _same, group, layout, stats, fused, docs, owned,
                                       scale)
        out = _from_inner_q(o_acc, q.dtype)
        ctx.group, ctx.layout, ctx.scale, ctx.g = group, layout, scale, g
        ctx.stats, ctx.fused, ctx.docs, ctx.owned = stats, fused, docs, owned
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        ctx.save_for_backward(qi, kv, out, lse_acc)
        return out

    @staticmethod
    def backward(ctx, dout):
        qi, kv, out, lse = ctx.saved_tensors
        g = ctx.g
        doi = _to_inner_q(dout, g)
        oi = _to_inner_q(out, g)
        dq, dkv_own = _ring_backward(qi, kv, _same, _same, doi, oi, lse, ctx.group, ctx.layout,
                                     ctx.stats, ctx.fused, ctx.docs, ctx.owned, ctx.scale)
        dq_out = _from_inner_q(dq, ctx.dtypes[0])
        dk = dkv_own[0].transpose(1, 2).to(ctx.dtypes[1])
        dv = dkv_own[1].transpose(1, 2).to(ctx.dtypes[2])
        return dq_out, dk, dv, None, None, None, None, None, None


def ring_attention(q, k, v, group: Any, layout: str = "zigzag", *,
                   stats: AttentionStats | None = None, fused: bool = True,
                   docs: torch.Tensor | None = None, balance: str = "zigzag") -> torch.Tensor:
    """``stats``: count the executed blocks' FLOPs there (forward and backward); ``fused``:
    False runs the explicit block math instead of the fused CPU kernel (any device and dtype);
    ``docs``: the document ids of the whole rows (b, S) — document masks: every chunk pair
    runs masked, a pair wholly in other documents is skipped (``doc_plan``); ``balance``
    ``ptrr``: the sequence was sharded by ``balanced_positions`` (document masks only)."""
    if group.size == 1:
        return layers.causal_attention(q, k, v) if docs is None else doc_attention(q, k, v, docs)
    return RingAttention.apply(q, k, v, group, layout, stats, fused, docs, balance)


# ---------------------------------------------------------------------------------- latent ring
def _expand_latent(lat: torch.Tensor, w: torch.Tensor, dn: int, dv: int) -> torch.Tensor:
    """A latent block (b, s, r_kv + d_r) → its K/V (2, b, H, s, d_q), the ring's layout: k =
    [W_kvb's nope rows · c ; kᴿ] per head, v = W_kvb's value rows · c zero-padded to d_q."""
    b, s, width = lat.shape
    r = w.shape[1]
    dr = width - r
    kv = torch.matmul(lat[..., :r], w.t()).view(b, s, -1, dn + dv)
    heads = kv.shape[2]
    k = torch.cat([kv[..., :dn], lat[..., None, r:].expand(b, s, heads, dr)], dim=-1)
    v = F.pad(kv[..., dn:], (0, dn + dr - dv))
    return torch.stack([k.transpose(1, 2), v.transpose(1, 2)])


def _latent_grad(dkv: torch.Tensor, lat: torch.Tensor, w: torch.Tensor, dw: torch.Tensor,
                 dn: int, dv: int) -> torch.Tensor:
    """``_expand_latent``'s backward: dK/dV (2, b, H, s, d_q) of one block → its dlatent (b, s,
    r_kv + d_r); W_kvb's gradient of the block is added into ``dw`` (in place)."""
    r = w.shape[1]
    dk, dvp = dkv[0].transpose(1, 2), dkv[1].transpose(1, 2)  # (b, s, H, d_q)
    b, s = dk.shape[0], dk.shape[1]
    dup = torch.cat([dk[..., :dn], dvp[..., :dv]], dim=-1).reshape(b * s, -1)
    dw.addmm_(dup.t(), lat[..., :r].reshape(b * s, r))
    dc = torch.matmul(dup, w).view(b, s, r)
    return torch.cat([dc, dk[..., dn:].sum(2)], dim=-1)


class LatentRingAttention(torch.autograd.Function):
    """MLA's causal attention over the cp-sharded sequence with the latent on the ring: q (b, s,
    H, d_q) local heads, ``latent`` (b, s, r_kv + d_r) — the normalised c and the rotated kᴿ —,
    ``w`` W_kvb (H·(d_n + d_v), r_kv) → (b, s, H, d_v). Each rank up-projects every block it
    receives; backward re-expands each block, sends dlatent home and adds W_kvb's gradient of
    every block locally. Saves q and the local latent (fp32), the d_v output and the lse."""

    @staticmethod
    def forward(ctx, q, latent, w, dims, group, layout, stats, fused, docs=None,
                balance="zigzag"):
        dn, dv = dims
        heads, dq = q.shape[2], q.shape[3]
        scale = 1.0 / math.sqrt(dq)
        qi = _to_inner_q(q, heads)
        lat = latent.float().contiguous()
        wf = w.float()
        owned = None if docs is None else rank_chunks(docs, group.size, layout, balance)
        o_acc, lse_acc = _ring_forward(qi, lat, lambda x: _expand_latent(x, wf, dn, dv), group,
                                       layout, stats, fused, docs, owned, scale)
        out = _from_inner_q(o_acc[..., :dv], q.dtype)
        ctx.group, ctx.layout, ctx.scale, ctx.dims = group, layout, scale, dims
        ctx.stats, ctx.fused, ctx.docs, ctx.owned = stats, fused, docs, owned
        ctx.dtypes = (q.dtype, latent.dtype)
        ctx.save_for_backward(qi, lat, w, out, lse_acc)
        return out

    @staticmethod
    def backward(ctx, dout):
        qi, lat, w, out, lse = ctx.saved_tensors
        dn, dv = ctx.dims
        heads, pad = qi.shape[1], qi.shape[-1] - dv
        wf = w.float()
        dw = torch.zeros_like(wf)
        doi = _to_inner_q(F.pad(dout, (0, pad)), heads)  # zero columns: the padded v's
        oi = _to_inner_q(F.pad(out, (0, pad)), heads)
        dq, dlat = _ring_backward(qi, lat, lambda x: _expand_latent(x, wf, dn, dv),
                                  lambda g, x: _latent_grad(g, x, wf, dw, dn, dv), doi, oi, lse,
                                  ctx.group, ctx.layout, ctx.stats, ctx.fused, ctx.docs,
                                  ctx.owned, ctx.scale)
        return (_from_inner_q(dq, ctx.dtypes[0]), dlat.to(ctx.dtypes[1]), dw.to(w.dtype),
                None, None, None, None, None, None, None)


class LatentRing(nn.Module):
    """MLA's core under ``--cp-mode ring-latent``: ``fived.model.mla.MLAttention`` hands it the
    latent (``latent_of``) instead of the decompressed heads. Under tensor parallelism W_kvb is
    column-cut (this rank's heads) and its input region is taken here: the latent is gathered
    over the sequence (SP) or passed whole, its gradient summed over tp, as the column layer
    does; the latent and the rotary key are whole on every tp rank."""

    takes_latent = True

    def __init__(self, group: Any, balance: str = "zigzag"):
        super().__init__()
        self.group, self.balance = group, balance

    def latent_of(self, attn: nn.Module, c: torch.Tensor, k_rope: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent (b, s, r_kv + d_r), W_kvb) of an ``MLAttention`` whose latent c (b, s,
        r_kv) is normalised and whose rotary key (b, s, 1, d_r) is rotated."""
        kv_b = attn.kv_b_proj
        w = kv_b.weight
        cols = getattr(kv_b, "columns", None)  # a tp-cut column layer: its input region
        if cols is not None:
            c = (comm_autograd.gather_from(c, cols.group, 1) if cols.sp
                 else comm_autograd.copy_to(c, cols.group))
            w = kv_b._replica(w)
        return torch.cat([c, k_rope.squeeze(2)], dim=-1), w

    def forward(self, q: torch.Tensor, latent: torch.Tensor, w: torch.Tensor, dims: tuple,
                docs: torch.Tensor | None = None) -> torch.Tensor:
        return LatentRingAttention.apply(q, latent, w, dims, self.group, "zigzag", None, True,
                                         docs, self.balance)


# ---------------------------------------------------------------------------------- Ulysses
def _natural_order(n: int, s_local: int, layout: str, device) -> torch.Tensor:
    """Global positions of the rows of a rank-major concatenation of every rank's shard."""
    return torch.cat([shard_positions(n * s_local, n, j, layout) for j in range(n)]).to(device)


def _seq_to_heads(x: torch.Tensor, group: Any, layout: str) -> torch.Tensor:
    """(b, s/n, H, d) sequence-sharded → (b, s, H/n, d) head-sharded, natural token order."""
    n = group.size
    b, s, hh, d = x.shape
    t = x.reshape(b, s, n, hh // n, d).permute(2, 1, 0, 3, 4).reshape(n * s, b, hh // n, d)
    t = comm_autograd.all_to_all(t, group)
    inv = torch.argsort(_natural_order(n, s, layout, x.device))
    return t[inv].permute(1, 0, 2, 3)


def _heads_to_seq(y: torch.Tensor, group: Any, layout: str) -> torch.Tensor:
    """Inverse of ``_seq_to_heads``: (b, s, H/n, d) → (b, s/n, H, d)."""
    n = group.size
    b, full, hn, d = y.shape
    s = full // n
    t = y.permute(1, 0, 2, 3)[_natural_order(n, s, layout, y.device)]
    t = comm_autograd.all_to_all(t.contiguous(), group)
    return t.reshape(n, s, b, hn, d).permute(2, 1, 0, 3, 4).reshape(b, s, n * hn, d)


def check_ulysses(heads: int, kv_heads: int, n: int) -> None:
    if heads % n:
        raise ConfigError([
            f"ulysses: local attention heads {heads} (heads/tp) are not divisible by cp={n}; "
            "use --cp-mode ring or a cp that divides heads/tp"])


def ulysses_attention(q, k, v, group: Any, layout: str = "zigzag",
                      docs: torch.Tensor | None = None) -> torch.Tensor:
    """``docs`` (b, S), the whole rows' document ids: the full-sequence core is
    ``doc_attention`` (per-document varlen) on the natural order."""
    n = group.size
    if n == 1:
        return layers.causal_attention(q, k, v) if docs is None else doc_attention(q, k, v, docs)
    h, g = q.shape[2], k.shape[2]
    check_ulysses(h, g, n)
    g2 = ulysses_kv_heads(h, g, n)
    if g2 != g:  # replicate kv heads so each rank receives those its query heads read
        k = k.repeat_interleave(g2 // g, dim=2)
        v = v.repeat_interleave(g2 // g, dim=2)
    qh, kh, vh = (_seq_to_heads(t, group, layout) for t in (q, k, v))
    o = layers.causal_attention(qh, kh, vh) if docs is None else doc_attention(qh, kh, vh, docs)
    return _heads_to_seq(o, group, layout)


# ---------------------------------------------------------------------------------- all-gather
def allgather_attention(q, k, v, group: Any, layout: str = "zigzag",
                        docs: torch.Tensor | None = None) -> torch.Tensor:
    """Baseline: all-gather K/V (reduce-scatter dK/dV in backward), attend with a position mask
    (and the document mask with ``docs``)."""
    n = group.size
    if n == 1:
        return layers.causal_attention(q, k, v) if docs is None else doc_attention(q, k, v, docs)
    b, s, h, d = q.shape
    kv = torch.stack([k, v])  # (2, b, s, g, d)
    full = comm_autograd.gather_from(kv.transpose(0, 2).contiguous(), group, 0)  # (n·s, b, 2, g, d)
    kpos = _natural_order(n, s, layout, q.device)
    qpos = shard_positions(n * s, n, group.rank, layout).to(q.device)
    kf, vf = full[:, :, 0].transpose(0, 1), full[:, :, 1].transpose(0, 1)  # (b, n·s, g, d)
    rep = h // k.shape[2]
    if rep > 1:
        kf, vf = kf.repeat_interleave(rep, dim=2), vf.repeat_interleave(rep, dim=2)
    mask = qpos[:, None] >= kpos[None, :]
    if docs is not None:
        mask = doc_mask(qpos, kpos, docs)[:, None]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2), attn_mask=mask,
        scale=1.0 / math.sqrt(d))
    return o.transpose(1, 2)


MODES = {"ring": ring_attention, "ulysses": ulysses_attention, "allgather": allgather_attention}


class ContextAttention(nn.Module):
    """The attention core of one layer with the sequence cut over the ``cp`` group."""

    def __init__(self, group: Any, mode: str = "ring", balance: str = "zigzag"):
        super().__init__()
        if mode not in MODES:
            raise ConfigError([f"--cp-mode {mode!r}: choose one of ring, ulysses"])
        self.group, self.mode = group, mode
        self.balance = balance  # --cp-balance ptrr: the ring's sharding with --doc-mask

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                docs: torch.Tensor | None = None) -> torch.Tensor:
        if docs is None:
            return MODES[self.mode](q, k, v, self.group)
        if self.balance != "zigzag":
            return ring_attention(q, k, v, self.group, docs=docs, balance=self.balance)
        return MODES[self.mode](q, k, v, self.group, docs=docs)


class ContextAhead(nn.Module):
    """Multi-token prediction's targets 0..D positions ahead (``fived.model.mtp.Ahead``) on a
    zigzag shard: rank r holds chunks r and 2·cp−1−r of c = S/(2·cp) tokens; chunk g's
    positions need, beyond its own targets, the first D targets of chunk g+1. One all-gather
    over cp of every rank's chunk heads (b·2·D token ids per rank, D ≤ c) gives each rank
    them: b·2·D·8·(cp−1) bytes received per rank per micro-batch, counted on ``cp``. With
    document masks a target counts only inside its token's document (``mtp.inside_of``)."""

    def __init__(self, group: Any):
        super().__init__()
        self.group = group

    def forward(self, targets: torch.Tensor, docs: torch.Tensor | None, depth: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        n, r = self.group.size, self.group.rank
        b, s = targets.shape
        c = s // 2
        heads = torch.stack([targets[:, :depth], targets[:, c:c + depth]], dim=1)  # (b, 2, D)
        every = ops.all_gather(heads.contiguous(), self.group, dim=0).view(n, b, 2, depth)
        head_of = {}
        for q in range(n):
            for a, g in enumerate(chunk_ids(q, n)):
                head_of[g] = every[q, :, a]
        cols, inside = [], []
        for a, g in enumerate(chunk_ids(r, n)):
            nxt = head_of.get(g + 1, targets.new_zeros(b, depth))
            ext = torch.cat([targets[:, a * c:(a + 1) * c], nxt], dim=1)
            cols.append(torch.stack([ext[:, j:j + c] for j in range(depth + 1)], dim=-1))
            pos = torch.arange(g * c, (g + 1) * c, device=targets.device)
            inside.append(inside_of(pos, 2 * n * c, depth, docs))
        return torch.cat(cols, dim=1), torch.cat(inside, dim=-2)


def apply_cp(model: nn.Module, group: Any, mode: str = "ring", balance: str = "zigzag"
             ) -> nn.Module:
    """Swap every attention core of a plain model (its multi-token prediction blocks too) for
    the cp one — ``mode`` ring, ulysses, or for an MLA model ring-latent (``LatentRing``) —
    (``balance``: the sharding of --cp-balance, ``zigzag`` or ``ptrr``); MoE layers
    (whose sequences are now cut) sum their routed counts over cp. The batch is sharded by
    ``shard_batch``."""
    if group.size == 1:
        return model
    if mode == "ring-latent" and not model.cfg.is_mla:
        raise ConfigError([f"--cp-mode ring-latent rotates MLA's latent; model {model.cfg.name} "
                           "has no latent (kv_lora_rank 0): use --cp-mode ring"])
    for block in [*model.layers.values(), *mtp_blocks(model)]:
        block.self_attn.core = (LatentRing(group, balance) if mode == "ring-latent"
                                else ContextAttention(group, mode, balance))
    if hasattr(model, "mtp"):  # the shifted targets cross the zigzag chunks' boundaries
        model.mtp.ahead = ContextAhead(group)
    for moe in moe_layers(model):
        add_count_reduction(moe, group)
    return model
