"""Traffic: bytes each rank sends per optimizer step, for every collective of every dimension.

Units are the runtime's ``fived.comm.ops.Traffic``: per *group name* (``dense``, ``expert``,
``tp``, ``cp``, ``ep``, ``pp``), the sum over calls of ``fived.comm.volume.bytes_sent(op, S, n)``
— the ring bytes this rank puts on the wire. Every function here returns a list of
``Collective`` (group, op, S, n, count); ``bytes_by_group`` sums them the way the runtime does,
call by call, so a test can compare with ``summary["history"][-1]["traffic"]`` exactly.

Per dimension (b = micro-batch sequences, s_l = seq_len/cp local tokens, e = activation bytes,
m = micro-batches, ℓ = layers on this rank, Ψ_g = parameters reduced over group g):

* DP / ZeRO (``dp_traffic``), per flat bucket of Ψ_b elements padded to P_b (a multiple of the
  group size N under ZeRO) — the buckets add up to the group's Ψ_g:
    ZeRO-0   all_reduce(grad_bytes·Ψ_b)                                  once per step
    ZeRO-1/2 reduce_scatter(grad_bytes·P_b) on the last micro-batch, all_gather(param_bytes·P_b)
             after the step; with the fp8 gather (``params.fp8_gather``: tensorwise,
             blockwise) a bucket of fp8 weights all_gather(1·P_b) after its tile amaxes'
             all_reduce(4·A_b) over the shards (tp > 1: and over tp, as ZeRO-3's)
    ZeRO-3   all_gather(param_bytes·P_b) before each micro-batch's forward and again before its
             backward; reduce_scatter(grad_bytes·P_b) once per step
             (not the root's: it stays gathered from its forward to its backward)
             →  (3Ψ − Ψ_root)(N−1)/N · param bytes per step with one micro-batch and grads in
             the param dtype
             fp8 gather (``params.fp8_gather``): a unit's fp8 weights are a bucket apart,
             gathered as all_gather(1·P_b) (rowwise under full recompute: its backward gathers
             both of W's casts, 2·P_b), and once per step its tile amaxes A_b (tensorwise one
             per weight, rowwise N + K, blockwise ⌈N/128⌉·⌈K/128⌉) all_reduce(4·A_b) over the
             shards (tp > 1, dense: and over tp, tensorwise 4·w, rowwise 4·h·w)
* TP (``tp_traffic``), per layer per micro-batch, X = b·s_l·h·e:
    no SP:  forward 2 all_reduce(X) (after wo, after w_down), backward 2 all_reduce(X)
    SP:     forward 2 all_gather(X) + 2 reduce_scatter(X), backward the same — equal bytes —
            plus 2 all_gather(X): the column inputs, saved as sequence shards, re-gathered
    full recompute: + 1 all_reduce(X) per layer (SP: + 2 all_gather + 1 reduce_scatter), the
    rerun forward stopping at the block's last saved tensor; tp > kv_heads: + 2 all_reduce of
    the (kv_heads·d, h) weight gradient per layer (qkv_bias: + 2 of the kv_heads·d bias
    gradient); ``qk_norm``: all_reduce(grad_bytes·d) per q/k norm per step, with or without SP
    (each rank normalises its own heads); plus the vocab-parallel ends: embedding
    forward all_reduce(X) (SP: reduce_scatter, backward all_gather), head input backward
    all_reduce(X) (SP: forward all_gather, backward all_gather + reduce_scatter), cross-entropy
    all_reduce(b·s_l·4) (max) and all_reduce(2·b·s_l·4) (Σexp, target logit); and under SP the
    replicated norm gains' gradients: all_reduce(grad_bytes·h) per norm on this rank (and the
    MoE router's, experts' and shared-expert gate's gradients).
    ``fived.parallel.tensor.tp_traffic_bytes`` sums it.
* PP (``pp_traffic``), per micro-batch per (virtual) stage boundary, Y = b·s_l·h·e (/tp under
  SP): a stage sends Y forward unless it is the last, and Y backward unless it is the first —
  unless the neighbouring stage is on the same rank (the V of zb-v / dualpipe-v: stage pp−1
  hands to stage pp locally, nothing sent).
* CP ring (``cp_traffic``), per layer per micro-batch, B = b·s_l·kv_local·d·e (one of K or V):
  forward (cp−1) sends of K and V (2B each), backward (cp−1)·2B again plus (cp−1)·2B of dK/dV;
  selective or full recompute reruns the forward ring once more.
  Ulysses: per layer and direction 4 all_to_all of q, k', v', out (full recompute: the
  forward's 4 once more; selective: q, k', v' once more).
* EP (``ep_traffic``), per MoE layer per micro-batch, T = b·s_l·top_k·h·e routed token bytes
  (s_l/tp under SP): the routing counts all_to_all(E·8 bytes), forward dispatch and combine
  all_to_all(T), backward the same two — (E − E/n)·8 + 4·(n−1)/n·T with uniform routing. The
  runtime's bytes follow the router: ``ep_routed_bytes`` gives them exactly from the recorded
  per-expert counts, (E − E/n)·8 per forward + 2·(S + R)·h·e (S rows sent away, R received).
  The token dispatch (``ep_dispatch = tokens``) sends D = ``ep_destinations_bound`` rows per
  token instead of k, plus 12 bytes per assignment (``ep_token_traffic``, ``ep_routed_bytes``).
* MoE under cp (and tp with SP): each MoE layer forward all_reduces its (b, E) fp32 routed
  counts over the groups that cut its sequence (the balance loss needs whole-sequence counts);
  a MoE block without a shared expert has only the attention's tp cut, so half the tp pairs.
* Multi-token prediction (``mtp_depth`` D, on the last stage): each module's block counts as a
  layer in every formula above; tp adds per module and micro-batch the embedding's and the
  head's collectives and the cross-entropy's (every local token: the positions without a
  target are ignored, not dropped), and under SP the gradients of its 3 norms (h) and of
  eh_proj (2h·h, whole on every tp rank); cp adds per micro-batch one all_gather of the chunk
  heads, cp·b·2·D int64 (``fived.parallel.context.ContextAhead``).
* Embedding group (``embed_traffic``): where the first and the last stage are two ranks that
  both hold the embedding, one all_reduce over the 2 of the embedding bucket's reduced shard.
* Loss-free balancing (``balance = "bias"``, ``bias_traffic``): once per step, after the
  optimizer step, all_reduce over ``batch`` (dp·ep) of the (ℓ_moe, E) int64 routed counts of
  the rank's MoE layers: 2·(n−1)/n · ℓ_moe·E·8 bytes, n = dp·ep.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..comm.volume import bytes_sent
from ..config import ModelConfig, ParallelConfig
from . import mla
from .context import ulysses_kv_heads
from .memory import (
    _state_key,
    act_bytes,
    buckets,
    embed_bucket,
    grad_bytes,
    group_sizes,
    param_bytes,
)
from .optimizers import opt_buckets
from .optimizers import traffic as optimizer_traffic_of
from .params import (
    ep_destinations_bound,
    fp8_gather,
    rank_moe_layers,
    rank_stages,
    stage_layers,
)

COUNT_BYTES = 8  # the ep routing counts travel as int64


@dataclass(frozen=True)
class Collective:
    group: str  # the runtime's group name the bytes are charged to
    op: str  # a fived.comm.volume op
    size: float  # S: the buffer the collective is named by, in bytes
    n: int  # ranks in the group
    count: int  # calls per optimizer step
    what: str = ""  # human label
    phase: str = "step"  # fwd | bwd | step

    @property
    def bytes_per_call(self) -> float:
        return bytes_sent(self.op, self.size, self.n)

    @property
    def bytes(self) -> float:
        return _repeat_sum(self.bytes_per_call, self.count)

    def as_dict(self) -> dict:
        return {"group": self.group, "op": self.op, "size": self.size, "n": self.n,
                "count": self.count, "what": self.what, "phase": self.phase,
                "bytes": self.bytes}


def _repeat_sum(x: float, count: int) -> float:
    """x added ``count`` times, as the runtime's counters add each call (bit-identical)."""
    if x == int(x) and abs(x) * count < 2**53:  # integer sums are exact: the product is equal
        return x * count
    if count > 100_000:
        return x * count
    total = 0.0
    for _ in range(count):
        total += x
    return total


def bytes_by_group(colls: list[Collective]) -> dict[str, float]:
    """The runtime's ``traffic`` dict: group name -> bytes sent, zero groups left out."""
    out: dict[str, float] = {}
    for c in colls:
        if c.n <= 1 or c.count == 0:
            continue
        out[c.group] = out.get(c.group, 0.0) + c.bytes
    return {k: v for k, v in out.items() if v}


def micro_batch_size(par: ParallelConfig, global_batch: int) -> int:
    """Sequences per micro-batch: the global batch over the batch group (dp·ep), over m."""
    return global_batch // (par.dp * par.ep) // par.micro_batches


def _local(m: ModelConfig, par: ParallelConfig, pp_rank: int) -> tuple[int, bool, bool]:
    """(transformer blocks on the rank — the last stage's MTP blocks too —, first, last)."""
    stages = rank_stages(par, pp_rank)
    n = par.pp * max(1, par.virtual_stages)
    layers = sum(len(stage_layers(m, par)[k]) for k in stages)
    return layers + (m.mtp_depth if n - 1 in stages else 0), 0 in stages, n - 1 in stages


# ------------------------------------------------------------------------ data parallel
def dp_traffic(m: ModelConfig, par: ParallelConfig, pp_rank: int = 0) -> list[Collective]:
    """Gradient reduction / ZeRO collectives over ``dense`` and ``expert`` for one step, one
    entry per flat bucket (``memory.buckets``) in launch order."""
    again = par.recompute == "full" and par.fp8 == "rowwise"  # both casts in backward
    return list(_dp_traffic(m, _state_key(par), par.micro_batches, pp_rank, again))


@lru_cache(maxsize=8192)
def _dp_traffic(m: ModelConfig, par: ParallelConfig, mb: int, pp_rank: int, again: bool = False
                ) -> tuple[Collective, ...]:
    out = list(_dp_flat(m, par, mb, pp_rank, again))
    if not par.hybrid:
        return tuple(out + _fp8_gather_tp(m, par, pp_rank))
    # hybrid sharding: ZeRO's collectives run on the shard part of each group, and each
    # bucket's reduced shard is all-reduced across the replicas (after its reduce-scatter)
    out = [Collective(f"{c.group}_shard", c.op, c.size, c.n, c.count, c.what, c.phase)
           for c in out]
    gb = grad_bytes(par)
    out += [Collective("dp_replicate", "all_reduce", gb * b.shard, par.replicate_degree, 1,
                       "shard's gradient across replicas", "bwd")
            for b in buckets(m, par, pp_rank)]
    return tuple(out + _fp8_gather_tp(m, par, pp_rank))


def _fp8_gather_tp(m: ModelConfig, par: ParallelConfig, pp_rank: int) -> list[Collective]:
    """ZeRO's fp8 gather under tp: the dense fp8 weights' amaxes that span the tp cut
    max-reduced over tp too (the whole weight's scale, as the tp-cut linear takes it), once per
    step, fp32: tensorwise one per weight, rowwise the h of the side the cut spans (a column
    layer's per-column amaxes, a row layer's per-row), blockwise none (its tiles stop at the
    cut)."""
    if par.tp <= 1 or par.fp8 == "blockwise":
        return []
    per = m.hidden if par.fp8 == "rowwise" else 1
    return [Collective("tp", "all_reduce", 4 * per * b.fp8, par.tp, 1, "fp8 weight amax (tp)",
                       "fwd") for b in buckets(m, par, pp_rank) if b.gathered_bytes_per_element
            and b.group == "dense"]


def _dp_flat(m: ModelConfig, par: ParallelConfig, mb: int, pp_rank: int, again: bool = False
             ) -> list[Collective]:
    """``again``: rowwise under full recompute, whose backward gathers both of W's casts."""
    gb, pb = grad_bytes(par), param_bytes(par)
    out: list[Collective] = []
    bks = [b for b in buckets(m, par, pp_rank) if group_sizes(par)[b.group] > 1]
    if par.zero == 3 and par.pp > 1 and par.zero3_pp_gather == "step":
        out += [Collective(b.group, "all_gather", (b.gathered_bytes_per_element or pb)
                           * b.padded, b.shards, 1, "params (once per step)", "fwd") for b in bks]
    elif par.zero == 3:
        for b in bks:
            eb = b.gathered_bytes_per_element or pb
            out.append(Collective(b.group, "all_gather", eb * b.padded, b.shards, mb,
                                  "params (forward)", "fwd"))
            if b.unit >= 0:  # the root stays gathered from its forward to its backward
                casts = 2 if again and b.gathered_bytes_per_element else 1
                out.append(Collective(b.group, "all_gather", casts * eb * b.padded, b.shards,
                                      mb, "params (backward)", "bwd"))
    if par.zero == 3:  # the fp8 gather's scales: each weight's tile amaxes over the shards
        out += [Collective(b.group, "all_reduce", 4 * b.fp8_amax, b.shards, 1,
                           "fp8 weight amax", "fwd") for b in bks if b.gathered_bytes_per_element]
    if par.zero == 3:
        out += [Collective(b.group, "reduce_scatter", gb * b.padded, b.shards, 1, "gradients",
                           "bwd") for b in bks]
        return out
    n = group_sizes(par)
    for b in bks:
        if par.zero == 0:
            out.append(Collective(b.group, "all_reduce", gb * b.numel, n[b.group], 1, "gradients",
                                  "bwd"))
        else:
            out.append(Collective(b.group, "reduce_scatter", gb * b.padded, b.shards, 1,
                                  "gradients", "bwd"))
    if par.zero in (1, 2):  # the fp8 gather's buckets: their amaxes, then e4m3 (1 byte)
        for b in bks:
            if b.gathered_bytes_per_element:
                out.append(Collective(b.group, "all_reduce", 4 * b.fp8_amax, b.shards, 1,
                                      "fp8 weight amax", "step"))
            out.append(Collective(b.group, "all_gather", (b.gathered_bytes_per_element or pb)
                                  * b.padded, b.shards, 1, "updated params", "step"))
    return out


# ------------------------------------------------------------------------ tensor parallel
def _fp8_amax(m: ModelConfig, par: ParallelConfig, tokens: int, dense: int, moe: int, mb: int,
              forwards: int) -> list[Collective]:
    """``--fp8``'s amax max-reductions over tp (``fived.parallel.fp8``), fp32, per micro-batch:
    a column layer (q, k, v, gate, up: N cut) tensorwise 1 float in forward (W) and 3 in
    backward (dy twice, W), rowwise one per token (dy's rows) and per input feature (W's
    columns) in backward; a row layer (wo, w_down: K cut) tensorwise 2 in forward (x, W) and 1
    in backward (W), rowwise one per token (x's rows) and per output feature (W's rows) in
    forward; blockwise none (its tiles stop at the cut). ``forwards``: 2 under full recompute.
    With ZeRO-3's fp8 gather of the dense group (``params.fp8_gather``) the weights arrive cast,
    their amax reduced once per step (``_fp8_gather_tp``): W's reductions leave (tensorwise: a
    column layer 0 forward, 2 backward; a row layer 1 forward, 0 backward; rowwise: the W rows'
    and columns' ones)."""
    recipe = getattr(par, "fp8", "none")
    if recipe not in ("tensorwise", "rowwise"):
        return []
    cols = 5 * dense + (3 + (2 if m.shared_expert else 0)) * moe
    rows = 2 * dense + (1 + (1 if m.shared_expert else 0)) * moe
    t, h = par.tp, m.hidden
    if recipe == "tensorwise":
        w = 0 if fp8_gather(par) and group_sizes(par)["dense"] > 1 else 1  # W cast here
        return [Collective("tp", "all_reduce", 4, t, (w * cols + (1 + w) * rows) * mb * forwards,
                           "fp8 amax (forward)", "fwd"),
                Collective("tp", "all_reduce", 4, t, ((2 + w) * cols + w * rows) * mb,
                           "fp8 amax (backward)", "bwd")]
    w = 0 if fp8_gather(par) and group_sizes(par)["dense"] > 1 else 1  # W cast here
    return [Collective("tp", "all_reduce", 4 * tokens, t, rows * mb * forwards,
                       "fp8 row amax of x (forward)", "fwd"),
            Collective("tp", "all_reduce", 4 * h, t, w * rows * mb * forwards,
                       "fp8 row amax of W (forward)", "fwd"),
            Collective("tp", "all_reduce", 4 * tokens, t, cols * mb,
                       "fp8 row amax of dy (backward)", "bwd"),
            Collective("tp", "all_reduce", 4 * h, t, w * cols * mb,
                       "fp8 column amax of W (backward)", "bwd")]


def tp_traffic(m: ModelConfig, par: ParallelConfig, micro_batch: int, pp_rank: int = 0,
               dtype_bytes: int | None = None) -> list[Collective]:
    """Tensor-parallel (and SP) collectives over ``tp`` for one step on one pipeline rank."""
    t = par.tp
    if t <= 1:
        return []
    e = dtype_bytes or act_bytes(par)
    layers, first, last = _local(m, par, pp_rank)
    mb = par.micro_batches
    tokens = micro_batch * m.seq_len // par.cp
    x = tokens * m.hidden * e
    sp = par.sequence_parallel
    per = layers * mb
    moe = rank_moe_layers(m, par, pp_rank)  # the rest (first_dense_layers) are dense blocks
    # tp-cut sublayers per block: attention and the MLP; a MoE block's routed experts are whole
    # on every tp rank (only a shared expert is cut), so it has the attention's pair alone
    cuts = 2 if (not m.is_moe or m.shared_expert) else 1
    cut = (cuts * moe + 2 * (layers - moe)) * mb
    out: list[Collective] = []
    # full recompute reruns each block's forward up to its last saved tensor (torch's
    # checkpoint stops early): the gathers and the attention's reduction again, not the MLP's
    again = par.recompute == "full"
    if m.is_mla:
        out += _mla_tp(m, par, micro_batch, e, layers, moe, cut - per, again)
    elif sp:
        if again:
            out += [Collective("tp", "all_gather", x, t, cut, "recompute: SP gathers", "bwd"),
                    Collective("tp", "reduce_scatter", x, t, per, "recompute: SP scatter after wo",
                               "bwd")]
        out += [Collective("tp", "all_gather", x, t, cut, "SP gather before attn/mlp", "fwd"),
                Collective("tp", "reduce_scatter", x, t, cut, "SP scatter after wo/w_down",
                           "fwd"),
                Collective("tp", "all_gather", x, t, cut, "grad of SP scatter", "bwd"),
                Collective("tp", "reduce_scatter", x, t, cut, "grad of SP gather", "bwd")]
        if getattr(par, "fp8", "none") == "none":  # fp8 columns save the gathered input
            out.append(Collective("tp", "all_gather", x, t, cut, "re-gather of SP column inputs",
                                  "bwd"))
        out += _moe_balance_counts(m, par, micro_batch, moe, "tp")
    else:
        if again:
            out.append(Collective("tp", "all_reduce", x, t, per, "recompute: after wo", "bwd"))
        out += [Collective("tp", "all_reduce", x, t, cut, "after wo, w_down", "fwd"),
                Collective("tp", "all_reduce", x, t, cut, "input grads of attn, mlp", "bwd")]
    out += _fp8_amax(m, par, tokens, layers - moe, moe, mb, 2 if again else 1)
    if t > m.kv_heads and not m.is_mla:  # replicated kv chunks: wk, wv grads summed over tp
        kv_weight = m.kv_heads * m.head_dim * m.hidden * e
        out.append(Collective("tp", "all_reduce", kv_weight, t, 2 * per,
                              "replicated kv-head weight grads", "bwd"))
        if m.qkv_bias:  # and the bk, bv gradients
            out.append(Collective("tp", "all_reduce", m.kv_heads * m.head_dim * e, t, 2 * per,
                                  "replicated kv-head bias grads", "bwd"))
    if m.qk_norm:  # the q/k norm gains see this rank's heads only, with or without SP
        out.append(Collective("tp", "all_reduce", m.head_dim * grad_bytes(par), t, 2 * layers,
                              "q/k norm-gain grads", "step"))
    # the embedding's lookups (the first stage's; each MTP module's on the last) and the heads
    # (the trunk's and each MTP module's, each with its cross-entropy over every local token)
    embeds = mb * ((1 if first else 0) + (m.mtp_depth if last else 0))
    heads = mb * (1 + m.mtp_depth) if last else 0
    if embeds:
        if sp:
            out += [Collective("tp", "reduce_scatter", x, t, embeds, "vocab embedding", "fwd"),
                    Collective("tp", "all_gather", x, t, embeds, "grad of embedding", "bwd")]
        else:
            out.append(Collective("tp", "all_reduce", x, t, embeds, "vocab embedding", "fwd"))
    if heads:
        if sp:
            out += [Collective("tp", "all_gather", x, t, heads, "head input", "fwd"),
                    Collective("tp", "all_gather", x, t, heads, "head input re-gather", "bwd"),
                    Collective("tp", "reduce_scatter", x, t, heads, "grad of head input", "bwd")]
        else:
            out.append(Collective("tp", "all_reduce", x, t, heads, "grad of head input", "bwd"))
        out.append(Collective("tp", "all_reduce", tokens * 4, t, heads, "vocab-parallel CE max",
                              "fwd"))
        out.append(Collective("tp", "all_reduce", 2 * tokens * 4, t, heads,
                              "vocab-parallel CE sum-exp + target logit", "fwd"))
    if sp:
        mtp = m.mtp_depth if last else 0  # enorm, hnorm, norm and eh_proj of each module
        norms = 2 * layers + (1 if last else 0) + 3 * mtp
        out.append(Collective("tp", "all_reduce", m.hidden * grad_bytes(par), t, norms,
                              "replicated norm-gain grads", "step"))
        if mtp:
            out.append(Collective("tp", "all_reduce", 2 * m.hidden * m.hidden * grad_bytes(par),
                                  t, mtp, "MTP eh_proj grads (sequence shards)", "step"))
        if m.is_moe:  # router and experts are replicated over tp and see different tokens
            gb = grad_bytes(par)
            out.append(Collective("tp", "all_reduce", m.hidden * m.experts * gb, t, moe,
                                  "router grads", "step"))
            out.append(Collective("tp", "all_reduce", m.hidden * m.expert_ffn * gb, t,
                                  3 * moe * (m.experts // par.ep), "expert grads", "step"))
            if m.shared_expert_gate:  # σ(w·x) reads the sequence shard too
                out.append(Collective("tp", "all_reduce", m.hidden * gb, t, moe,
                                      "shared-expert gate grads", "step"))
    return out


def _mla_tp(m: ModelConfig, par: ParallelConfig, micro_batch: int, e: int, layers: int,
            moe: int, mlp: int, again: bool) -> list[Collective]:
    """MLA's tp collectives (``fived.parallel.tensor``'s MLA rows) and its MLP's, per step:
    the column regions read the latents (r_q, or x without query compression, and r_kv), the
    rotary key (d_r) is summed over tp (gathered with SP), o_proj is a row layer; ``mlp``
    counts the blocks·micro-batches whose MLP is tp-cut. With SP the down-projections and
    latent norms see this rank's sequence shard: their gradients are all-reduced per step."""
    t, mb, sp = par.tp, par.micro_batches, par.sequence_parallel
    per = layers * mb
    tokens = micro_batch * m.seq_len // par.cp
    x = tokens * m.hidden * e
    cols = [tokens * w * e for w in (m.q_lora_rank or m.hidden, m.kv_lora_rank)]
    key = tokens * m.qk_rope_head_dim * e
    out: list[Collective] = []

    def add(op: str, size: float, count: int, what: str, phase: str) -> None:
        if count:
            out.append(Collective("tp", op, size, t, count, what, phase))

    if not sp:
        if again:
            add("all_reduce", x, per, "recompute: after o_proj", "bwd")
        add("all_reduce", x, per + mlp, "after o_proj, w_down", "fwd")
        for c in cols:
            add("all_reduce", c, per, "input grads of MLA's up-projections", "bwd")
        add("all_reduce", key, per, "rotary key grad (shared by the heads)", "bwd")
        add("all_reduce", x, mlp, "input grads of mlp", "bwd")
        return out
    gathers = [(c, per) for c in cols] + [(key, per), (x, mlp)]
    if again:
        for c, n in gathers:
            add("all_gather", c, n, "recompute: SP gathers", "bwd")
        add("reduce_scatter", x, per, "recompute: SP scatter after o_proj", "bwd")
    for c, n in gathers:
        add("all_gather", c, n, "SP gather of the latents, rotary key, mlp input", "fwd")
    add("reduce_scatter", x, per + mlp, "SP scatter after o_proj/w_down", "fwd")
    add("all_gather", x, per + mlp, "grad of SP scatter", "bwd")
    # the latent ring (--cp-mode ring-latent) keeps the gathered latent: W_kvb's input is not
    # gathered again in backward
    regathered = cols[:1] if par.cp > 1 and par.cp_mode == "ring-latent" else cols
    for c, n in [(c, per) for c in regathered] + [(x, mlp)]:
        add("all_gather", c, n, "re-gather of SP column inputs", "bwd")
    for c, n in gathers:
        add("reduce_scatter", c, n, "grad of SP gather", "bwd")
    out += _moe_balance_counts(m, par, micro_batch, moe, "tp")
    gb = grad_bytes(par)
    for name, n, whole in mla.weights(m, t):
        if whole:
            add("all_reduce", n * gb, layers, f"{name} grad (sequence shard)", "step")
    return out


# ------------------------------------------------------------------------ pipeline
def pp_traffic(m: ModelConfig, par: ParallelConfig, micro_batch: int, pp_rank: int = 0,
               dtype_bytes: int | None = None) -> list[Collective]:
    """Point-to-point sends over ``pp`` for one step on pipeline rank ``pp_rank``."""
    if par.pp <= 1:
        return []
    e = dtype_bytes or act_bytes(par)
    tokens = micro_batch * m.seq_len // par.cp
    sp = par.sequence_parallel and par.tp > 1
    y = tokens * m.hidden * e // (par.tp if sp else 1)
    n_stages = par.pp * max(1, par.virtual_stages)
    stages = rank_stages(par, pp_rank)
    fwd = sum(1 for k in stages if k < n_stages - 1 and k + 1 not in stages)
    bwd = sum(1 for k in stages if k > 0 and k - 1 not in stages)
    mb = par.micro_batches
    out = []
    if fwd:
        out.append(Collective("pp", "send", y, par.pp, fwd * mb, "activations", "fwd"))
    if bwd:
        out.append(Collective("pp", "send", y, par.pp, bwd * mb, "activation grads", "bwd"))
    return out


# ------------------------------------------------------------------------ context parallel
def cp_traffic(m: ModelConfig, par: ParallelConfig, micro_batch: int, pp_rank: int = 0,
               dtype_bytes: int | None = None) -> list[Collective]:
    """Ring (or Ulysses) exchange over ``cp`` for one step on one pipeline rank."""
    c = par.cp
    if c <= 1:
        return []
    e = dtype_bytes or act_bytes(par)
    layers, _, _ = _local(m, par, pp_rank)
    per = layers * par.micro_batches
    tokens = micro_batch * m.seq_len // c
    d = m.qk_head_dim  # MLA: the decompressed heads, v padded to d_q (fived.model.mla)
    kv_local = m.heads // par.tp if m.is_mla else max(1, m.kv_heads // par.tp)
    if par.cp_mode == "ulysses":
        q = tokens * (m.heads // par.tp) * d * e
        # kv heads as the all-to-all sees them (replicated up to cp, or to the query heads)
        k = tokens * ulysses_kv_heads(m.heads // par.tp, kv_local, c) * d * e
        out = [Collective("cp", "all_to_all", q, c, 2 * per, "q and out", "fwd"),
               Collective("cp", "all_to_all", k, c, 2 * per, "k and v", "fwd"),
               Collective("cp", "all_to_all", q, c, 2 * per, "grads of q and out", "bwd"),
               Collective("cp", "all_to_all", k, c, 2 * per, "grads of k and v", "bwd")]
        if par.recompute in ("full", "selective"):  # the forward's all-to-alls again: full
            # reruns the block (q, k, v and out), selective the core (q, k, v in; its output
            # is not checkpointed's to redo)
            out += [Collective("cp", "all_to_all", q, c, (2 if par.recompute == "full" else 1)
                               * per, "recompute: q (and out)", "bwd"),
                    Collective("cp", "all_to_all", k, c, 2 * per, "recompute: k and v", "bwd")]
    elif par.cp_mode == "ring-latent":  # MLA's latent [c ; kᴿ] and dlatent, fp32
        lat = tokens * (m.kv_lora_rank + m.qk_rope_head_dim) * 4
        hops = (c - 1) * per
        out = [Collective("cp", "send", lat, c, hops, "latent ring", "fwd"),
               Collective("cp", "send", lat, c, hops, "latent ring again", "bwd"),
               Collective("cp", "send", lat, c, hops, "dlatent ring", "bwd")]
        if par.recompute in ("full", "selective"):  # the attention core's forward runs again
            out.append(Collective("cp", "send", lat, c, hops, "recompute: latent ring", "bwd"))
    else:
        b = tokens * kv_local * d * 4  # one of K or V: the ring sends them (and dK/dV) in fp32
        hops = (c - 1) * per
        out = [Collective("cp", "send", 2 * b, c, hops, "K/V ring", "fwd"),
               Collective("cp", "send", 2 * b, c, hops, "K/V ring again", "bwd"),
               Collective("cp", "send", 2 * b, c, hops, "dK/dV ring", "bwd")]
        if par.recompute in ("full", "selective"):  # the attention core's forward runs again
            out.append(Collective("cp", "send", 2 * b, c, hops, "recompute: K/V ring", "bwd"))
    if m.mtp_depth and _local(m, par, pp_rank)[2]:  # the chunk heads of the shifted targets
        out.append(Collective("cp", "all_gather", c * micro_batch * 2 * m.mtp_depth * COUNT_BYTES,
                              c, par.micro_batches, "MTP: next chunks' first targets", "fwd"))
    moe = rank_moe_layers(m, par, pp_rank)
    out += _fp8_cp_amax(m, par, layers - moe, moe, 2 if par.recompute == "full" else 1)
    return out + _moe_balance_counts(m, par, micro_batch, moe, "cp")


def _fp8_cp_amax(m: ModelConfig, par: ParallelConfig, dense: int, moe: int, forwards: int
                 ) -> list[Collective]:
    """``--fp8``'s amax max-reductions over cp (the scales that span the tokens,
    ``fived.parallel.fp8``), fp32, per micro-batch, in the blocks' attention, dense MLP and
    shared expert (a routed expert's casts are its own): tensorwise one float per distinct
    input in forward (q/k/v share one cast, gate/up another: 4 per dense block; under full
    recompute one per linear more, the checkpointed forward's casts are not shared) and two per
    linear in backward (dy for dgrad, dyᵀ for wgrad); rowwise, in backward, one float per
    output feature (dyᵀ's rows) and per input feature (x's columns) of each linear, both as a
    rank holds them under tp; blockwise none (its token tiles stop at the chunk edges).
    ``forwards``: 2 under full recompute."""
    recipe = getattr(par, "fp8", "none")
    if recipe not in ("tensorwise", "rowwise"):
        return []
    c, mb, t, h = par.cp, par.micro_batches, par.tp, m.hidden
    kv = m.kv_heads * m.head_dim // min(t, m.kv_heads)
    attn = [(m.attn_dim // t, h), (kv, h), (kv, h), (h, m.attn_dim // t)]  # (N, K): q k v o

    def mlp(ffn: int) -> list[tuple[int, int]]:  # (N, K): gate up down
        return [(ffn // t, h), (ffn // t, h), (h, ffn // t)]
    shared = mlp(m.shared_ffn) if m.shared_expert else []
    blocks = [(attn + mlp(m.ffn), dense, 4), (attn + shared, moe, 2 + (2 if shared else 0))]
    if recipe == "tensorwise":
        # under full recompute the checkpointed forward keeps no cast, so each linear casts
        # its input (no sharing); the rerun shares them again
        return [Collective("cp", "all_reduce", 4, c,
                           (ins + (len(lin) if forwards == 2 else 0)) * n * mb,
                           "fp8 amax over the tokens (forward)", "fwd")
                for lin, n, ins in blocks if n] + \
               [Collective("cp", "all_reduce", 4, c, 2 * len(lin) * n * mb,
                           "fp8 amax over the tokens (backward)", "bwd") for lin, n, _ in blocks
                if n]
    sizes: dict[int, int] = {}
    for lin, n, _ in blocks:
        for nk in lin:
            for f in nk:
                sizes[f] = sizes.get(f, 0) + n * mb
    return [Collective("cp", "all_reduce", 4 * f, c, k, "fp8 wgrad amax along the tokens", "bwd")
            for f, k in sorted(sizes.items()) if k]


def _moe_balance_counts(m: ModelConfig, par: ParallelConfig, micro_batch: int, layers: int,
                        group: str) -> list[Collective]:
    """A MoE layer whose sequence is cut (over cp, and over tp under SP) sums its routed counts
    there for the balance loss: all_reduce of (b, E) fp32 per layer forward (twice with full
    recompute, whose rerun forward passes through the router again)."""
    if not m.is_moe:
        return []
    calls = layers * par.micro_batches * (2 if par.recompute == "full" else 1)
    return [Collective(group, "all_reduce", micro_batch * m.experts * 4, par.degree(group), calls,
                       "MoE routed counts (balance loss)", "fwd")]


# ------------------------------------------------------------------------ expert parallel
def ep_traffic(m: ModelConfig, par: ParallelConfig, micro_batch: int, pp_rank: int = 0,
               dtype_bytes: int | None = None) -> list[Collective]:
    """Token all-to-alls over ``ep`` for one step (uniform routing) on one pipeline rank."""
    if par.ep <= 1 or not m.is_moe:
        return []
    e = dtype_bytes or act_bytes(par)
    per = rank_moe_layers(m, par, pp_rank) * par.micro_batches
    sp = par.sequence_parallel and par.tp > 1
    tokens = micro_batch * m.seq_len // par.cp // (par.tp if sp else 1)
    if par.ep_dispatch == "tokens":
        return ep_token_traffic(m, par, tokens, per, e)
    size = tokens * m.top_k * m.hidden * e
    out = [Collective("ep", "all_to_all", m.experts * COUNT_BYTES, par.ep, per,
                      "routing counts (E int64)", "fwd"),
           Collective("ep", "all_to_all", size, par.ep, 2 * per, "dispatch + combine", "fwd"),
           Collective("ep", "all_to_all", size, par.ep, 2 * per, "their grads", "bwd")]
    if par.recompute == "full":  # the block's forward reruns through the combine
        out += [Collective("ep", "all_to_all", m.experts * COUNT_BYTES, par.ep, per,
                           "recompute: routing counts", "bwd"),
                Collective("ep", "all_to_all", size, par.ep, 2 * per,
                           "recompute: dispatch + combine", "bwd")]
    return out


def ep_token_traffic(m: ModelConfig, par: ParallelConfig, tokens: int, per: int, e: int
                     ) -> list[Collective]:
    """The token dispatch (``ep_dispatch = tokens``) at its bound: each of the rank's ``tokens``
    reaches D = ``ep_destinations_bound`` ep ranks (T = tokens·D·h·e), each of its k
    assignments carries its place (int64) and fp32 weight; the counts exchange also carries the
    rows per rank (n·(E/n + 1) int64). Uniform routing over the D ranks gives, per MoE layer
    and micro-batch, (n−1)·(E/n+1)·8 + (n−1)/n·(4·T + 16·tokens·k)."""
    n, k = par.ep, m.top_k
    size = tokens * ep_destinations_bound(m, par) * m.hidden * e
    head = n * (m.experts // n + 1) * COUNT_BYTES
    meta = tokens * k * (COUNT_BYTES + 4)
    out = [Collective("ep", "all_to_all", head, n, per, "routing counts + rows per rank", "fwd"),
           Collective("ep", "all_to_all", meta, n, per, "assignments: place + weight", "fwd"),
           Collective("ep", "all_to_all", size, n, 2 * per, "tokens + their sums", "fwd"),
           Collective("ep", "all_to_all", size, n, 2 * per, "their grads", "bwd"),
           Collective("ep", "all_to_all", tokens * k * 4, n, per, "weights' grads", "bwd")]
    if par.recompute == "full":
        out += [Collective("ep", "all_to_all", head, n, per, "recompute: counts", "bwd"),
                Collective("ep", "all_to_all", meta, n, per, "recompute: assignments", "bwd"),
                Collective("ep", "all_to_all", size, n, 2 * per, "recompute: tokens + sums",
                           "bwd")]
    return out


def ep_routed_bytes(m: ModelConfig, counts: list[list[list[float]]],
                    ep_groups: list[tuple[int, ...]], forwards: list[int], dtype_bytes: int = 4,
                    recompute_full: bool = False,
                    sent_rows: list[list[list[float]]] | None = None) -> list[float]:
    """Exact ep bytes each rank sends in one step, from the routing the runtime recorded.

    ``counts[r][l][e]``: rows rank r routed to expert e in layer l (summed over micro-batches,
    kept rows only); ``ep_groups``: the ep groups (member ranks in ep order); ``forwards[r]``:
    MoE layer forwards rank r ran, each with one counts exchange. Rank i of a group of n owns
    experts i·E/n … (i+1)·E/n − 1; with S rows sent to experts it does not own and R rows
    received for its own, it sends per step

        forwards·(E − E/n)·8  +  2·(S + R)·h·e           (forward dispatch + combine, backward)

    and full recompute runs the forward (counts and both row all-to-alls) once more.

    With the token dispatch (``ep_dispatch = tokens``, ``sent_rows[r][l][j]``: token rows rank r
    sent to the j-th member of its ep group in layer l) a rank sends, with S_u, R_u the token
    rows it sends to and receives from the others and S, R the assignments as above,

        forwards·(n−1)·(E/n + 1)·8                      counts and rows per rank
        + S·(8 + 4)                                     each assignment's place and fp32 weight
        + 2·(S_u + R_u)·h·e                             tokens out, sums back; their grads
        + R·4                                           the weights' grads

    (full recompute: the forward's terms, forwards·(n−1)·(E/n+1)·8 + S·12 + (S_u + R_u)·h·e,
    once more)."""
    again = 1 if recompute_full else 0
    E = m.experts
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
            if sent_rows is None:
                out[r] = ((1 + again) * forwards[r] * (E - per) * COUNT_BYTES
                          + (2 + again) * (sent + recv) * m.hidden * dtype_bytes)
                continue
            su = sum(v for lay in sent_rows[r] for j, v in enumerate(lay) if j != i)
            ru = sum(sent_rows[q][lay][i] for q in members if q != r
                     for lay in range(len(sent_rows[q])))
            out[r] = ((1 + again) * (forwards[r] * (n - 1) * (per + 1) * COUNT_BYTES
                                     + sent * (COUNT_BYTES + 4))
                      + (2 + again) * (su + ru) * m.hidden * dtype_bytes + recv * 4)
    return out


def bias_traffic(m: ModelConfig, par: ParallelConfig, pp_rank: int = 0) -> list[Collective]:
    """balance = bias: the step's routed counts of the rank's MoE layers, (ℓ_moe, E) int64,
    summed over ``batch`` (dp·ep) once per step for the bias update
    (``fived.parallel.balance.global_routed_counts``)."""
    layers = rank_moe_layers(m, par, pp_rank) if m.is_moe and m.balance == "bias" else 0
    if not layers:
        return []
    return [Collective("batch", "all_reduce", layers * m.experts * COUNT_BYTES, par.dp * par.ep,
                       1, "loss-free balance: routed counts (int64)", "step")]


# ------------------------------------------------------------------------ embedding group
def embed_traffic(m: ModelConfig, par: ParallelConfig, pp_rank: int = 0) -> list[Collective]:
    """Megatron's embedding group: on the pipeline's first and last rank, when both hold the
    embedding (tied head, MTP), one all_reduce over ``embed`` (2 ranks) of the embedding
    bucket's reduced shard (grad_bytes · padded/N; without ZeRO the whole V·h/tp) per step."""
    b = embed_bucket(m, par, pp_rank)
    if b is None:
        return []
    return [Collective("embed", "all_reduce", grad_bytes(par) * b.shard, 2, 1,
                       "embedding group: the two copies' gradients", "step")]


# ------------------------------------------------------------------------ everything
def optimizer_traffic(m: ModelConfig, par: ParallelConfig, pp_rank: int = 0,
                      optimizer: str = "adamw") -> list[Collective]:
    """The optimizer's own collectives (row/column statistics, Muon's gathers):
    ``fived.ledger.optimizers.traffic``."""
    if optimizer == "adamw":
        return []
    obs = opt_buckets(m, _state_key(par), pp_rank, tuple(buckets(m, par, pp_rank)))
    shard = "_shard" if par.hybrid else ""  # ZeRO's groups are the shard parts when hybrid
    return [Collective(g + shard if g in ("dense", "expert") else g, op, float(size), n, 1,
                       f"{optimizer} state", "step")
            for g, op, size, n in optimizer_traffic_of(obs, par, optimizer)]


def step_traffic(m: ModelConfig, par: ParallelConfig, micro_batch: int, pp_rank: int = 0,
                 optimizer: str = "adamw") -> list[Collective]:
    """Every collective one rank at pipeline coordinate ``pp_rank`` runs in one step."""
    return (dp_traffic(m, par, pp_rank) + tp_traffic(m, par, micro_batch, pp_rank)
            + pp_traffic(m, par, micro_batch, pp_rank) + cp_traffic(m, par, micro_batch, pp_rank)
            + ep_traffic(m, par, micro_batch, pp_rank) + bias_traffic(m, par, pp_rank)
            + embed_traffic(m, par, pp_rank) + optimizer_traffic(m, par, pp_rank, optimizer))


def step_bytes(m: ModelConfig, par: ParallelConfig, micro_batch: int, pp_rank: int = 0,
               optimizer: str = "adamw") -> dict[str, float]:
    return bytes_by_group(step_traffic(m, par, micro_batch, pp_rank, optimizer))
