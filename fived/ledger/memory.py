"""Memory per rank: model states (by precision and ZeRO stage), activations, pipeline in-flight
factor and communication buffers — every term listed, never only a total.

Model states (Rajbhandari et al. 2020, "ZeRO"; Ψ = parameters this rank holds)
--------------------------------------------------------------------------------
bytes per element                 params  grads  master  Adam m,v   total
fp32                              4       4      0       8          16Ψ  (params are the master)
bf16/fp16, grad_reduce_dtype bf16 2       2      4       8          16Ψ
bf16/fp16, grad_reduce_dtype fp32 2       4      4       8          18Ψ  (fp32 gradient buffer)

ZeRO over the data-parallel group of N ranks (``dense`` = dp·ep·cp for dense parameters,
``expert`` = dp·cp for expert parameters): stage 1 shards master + optimizer, stage 2 also the
gradients, stage 3 also the parameters. The engine lays parameters out in flat *buckets*
(``buckets``: reverse registration order, ≤ ``bucket_mb`` MiB each; ZeRO-3 one per block); under
ZeRO each bucket is padded to a multiple of N so all shards are equal. The keys count the
tensors as held (padded), ``padding`` the padding's share (full buffer: its pad; a shard: pad/N),
so keys = formula(Ψ) + padding. The keys match the runtime's ``engine.memory()``: params, grads,
master, optimizer, buffers, padding. ZeRO-1/2 with the fp8 parameter all-gather
(``params.fp8_gather``: tensorwise, blockwise) hold the fp8 linears' Ψ_f8 as a compute-dtype
shard, the whole e4m3 cast and its scales (A tile amaxes): params P·Ψ_f8 become
P·Ψ_f8/N + 1·Ψ_f8 + 4·A (those buckets' padding pad·P/N + pad).

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", redone for the Llama block: RMSNorm, RoPE, GQA, SwiGLU, no dropout, no biases)
------------------------------------------------------------------------------------------
Per layer and per token of a micro-batch (e = activation bytes, h hidden, hq = heads·d,
hkv = kv_heads·d with d = head_dim, f ffn, a heads), what autograd saves in the fived runtime
(q/k/v biases save nothing: a bias's gradient is the sum of the output's):

    2 RMSNorms      2·(2e·h + 4)            input, output (saved by the next matmul), fp32
                                            1/rms (``fived.model.layers._RMSNorm``; eager fp32
                                            math, ``fused_norm=False``: 2·(8h + e·h + 4))
    q, k, v         e·(hq + 2·hkv)          after RoPE, kv heads not repeated (flash with GQA,
                                            ``layers.flash_attention``; ``kv_repeat``: hkv = hq)
    q/k norms       e·(hq + hkv) + 4·(a + g)  ``qk_norm`` only: each head's input and its fp32
                                            1/rms (g kv heads; eager fp32 math: 8·(hq + hkv) +
                                            4·(a + g)); RoPE saves none of their outputs
    softmax         flash: 4·a (fp32 log-sum-exp)   materialised: e·a·s_kv (probabilities)
    attention out   e·hq                    (also the input of wo)
    SwiGLU          3·e·f                   gate out, up out (``layers._SwiGLU``, silu
                                            recomputed in backward), their product (w_down's)

With ``--fp8 tensorwise|blockwise`` (``fived.model.fp8``) each linear layer saves its input as
fp8, the linears reading one tensor sharing one copy: the norms' outputs (2·e·h) and the SwiGLU
product (e·f) are no longer saved in e bytes; the fp8 copies are h (q/k/v's input), hq (wo's:
the attention output stays saved by the kernel), h (gate/up's) and f (w_down's) bytes, each
with its scales: tensorwise 4 bytes per copy and micro-batch, blockwise 4 per 128-wide tile of
each token's row, 4·⌈K/128⌉. ``rowwise`` saves its inputs in e bytes: no change, but under
sequence parallelism, where its column layers save the gathered input (2·e·h per token, whole
sequence) instead of the norm outputs' shards. Under sequence parallelism the fp8 copies hold
the gathered sequence (the norm input stays a shard). wo's bf16 input leaves where it was a
tensor of its own (tensorwise, blockwise): under Ulysses the all-to-all's sequence-sharded
output (the kernel's head-sharded one stays), under selective recompute the checkpointed
core's output (``fp8_ulysses_out``, ``selective_layer``). A MoE block's
experts under fp8 run as a loop of fp8 linears: each local expert saves its routed rows (h) and
its SwiGLU product (f_e) as fp8 copies in place of the permuted rows and the product, with their
scales (tensorwise 4 B per copy and local expert, blockwise per 128-tile of each row); a shared
expert changes as a dense MLP does (``fp8_moe_saves``).

With tp the q/k/v/attention/SwiGLU terms divide by tp (k, v by min(tp, kv_heads)); the norm
terms divide by tp only under sequence parallelism, where the column matmuls save the norm
output's sequence shard and all-gather it again in backward (``fived.parallel.tensor``).
With hq = h, bf16 and SP that is 12h/t + 4·hkv/t + 6f/t (+ 8/t + 4a/t) bytes per token:
Megatron-Core's number (docs/ledger.md derives it from its source).
With cp each rank holds s/cp tokens (the
materialised scores are (s/cp)×s). Recompute: ``selective`` checkpoints the attention core
(keeps q, k, v with kv heads unrepeated and the output; drops the softmax term); ``full`` keeps
only each block's input (e·h per token) plus one layer's full activations while it recomputes.
The first stage also keeps the token ids (8 B/token); the last stage the final norm, the logits
in the compute dtype (e·V/tp per token) with the fp32 log-sum-exp (tp: max and sum of
exponentials, 8 B), and the targets (8 B/token; tp: + 1 B "in this vocab slice").

Document masks (``--doc-mask``, ``ActivationOptions.doc_mask``): RoPE positions are per row, so
the cos/sin tables are b pairs (b·s_local·d·e, not s_local·d·e); the per-document varlen core
(one rank, tp, pp, Ulysses) adds per layer 16 B per token of the whole rows (the scatter's two
int64 indexes) and, without cp, a second copy of its output (e·hq/tp: the segments' kernels
saved theirs, the next matmul keeps the scattered one) — ``doc_core_bytes``; the ring saves
nothing more; under selective recompute the core's saves are recomputed and the checkpoint
keeps the rows' ids (8 B per token of the rank's batch rows: one storage, the micro-batches'
checkpoints keep views of it).

Pipeline in-flight factor (Narayanan et al. 2021): micro-batches whose activations a pipeline
rank r holds at its peak — GPipe m; 1F1B and ZB-H1 min(p − r, m); interleaved with v chunks
(2(p−r−1) + (v−1)p + 1)/v, which for r = 0 is p·(1 + (p−1)/(p·v)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from .. import schedules
from ..config import V_SCHEDULES, ModelConfig, ParallelConfig, precision_of
from .context import ulysses_kv_heads
from .optimizers import opt_buckets
from .optimizers import state_bytes as optimizer_state_bytes
from .params import (
    ep_destinations_bound,
    layer_cfg,
    layer_kinds,
    rank_stages,
    stage_layers,
    zero3_unit,
)

GB = 1e9
GIB = 2**30


# ------------------------------------------------------------------------ precision
def param_bytes(par: ParallelConfig) -> int:
    return 4 if precision_of(par) == "fp32" else 2


def grad_bytes(par: ParallelConfig) -> int:
    """The gradient buffer's element size: fp32 training 4; mixed precision follows
    ``grad_reduce_dtype`` (fp32: 4 → 18Ψ, bf16: 2 → 16Ψ)."""
    if precision_of(par) == "fp32":
        return 4
    return 4 if par.grad_reduce_dtype == "fp32" else 2


def master_bytes(par: ParallelConfig) -> int:
    """fp32 master 4; without one (``--master-weights none|sr``) 0; Kahan's bf16 compensation 2."""
    if precision_of(par) == "fp32":
        return 0
    return {"fp32": 4, "kahan": 2}.get(par.master_weights, 0)


OPTIMIZER_BYTES = 8  # Adam m and v in fp32


def act_bytes(par: ParallelConfig) -> int:
    return 4 if precision_of(par) == "fp32" else 2


def bytes_per_param(par: ParallelConfig) -> int:
    """Model-state bytes per parameter without ZeRO: 16 or 18."""
    return param_bytes(par) + grad_bytes(par) + master_bytes(par) + OPTIMIZER_BYTES


# ------------------------------------------------------------------------ ZeRO shards
def shard_len(numel: int, n: int) -> int:
    """Elements of one shard of a flat buffer of ``numel`` padded to n·⌈numel/n⌉."""
    return -(-numel // n) if n > 1 else numel


def shard_real(numel: int, n: int, index: int) -> int:
    """Real (non-padding) elements in shard ``index`` of ``n``."""
    if n <= 1:
        return numel
    k = shard_len(numel, n)
    return max(0, min(numel, (index + 1) * k) - index * k)


def group_sizes(par: ParallelConfig) -> dict[str, int]:
    """Sizes of the groups ZeRO shards over: dense = dp·ep·cp, expert = dp·cp; with hybrid
    sharding (``--dp-shard N``) their shard parts, N·ep·cp and N·cp (states ÷ N, not dp)."""
    n = par.shard_degree
    return {"dense": n * par.ep * par.cp, "expert": n * par.cp}


@dataclass(frozen=True, slots=True)
class Bucket:
    """One flat buffer of the data-parallel engine: ``numel`` parameters reduced over ``group``,
    padded to ``padded`` (a multiple of ``shards`` = N under ZeRO, else numel)."""

    group: str
    numel: int
    shards: int
    unit: int = -1  # ZeRO-3: the block it gathers with (-1: the root — embedding, norm, head)
    aligned: int = 0  # --zero-align rows: the padded length with row-aligned shards (0: none)
    fp8: int = 0  # ZeRO-3's fp8 gather: the fp8 weights it holds, gathered in e4m3 (0: none)
    fp8_amax: int = 0  # their tile amaxes reduced once per step (fived.parallel.data.fp8)

    @property
    def gathered_bytes_per_element(self) -> int:
        """1 (e4m3) for a bucket ZeRO-3 gathers in fp8 (its fp8 weights, sharded: N > 1);
        else 0, the caller's compute dtype."""
        return 1 if self.fp8 and self.shards > 1 else 0

    @property
    def padded(self) -> int:
        return self.aligned or -(-self.numel // self.shards) * self.shards

    @property
    def shard(self) -> int:
        return self.padded // self.shards

    @property
    def pad(self) -> int:
        return self.padded - self.numel


def split_sizes(sizes: list[int], cap: int) -> list[list[int]]:
    """Consecutive runs of ``sizes``, each closed before it would exceed ``cap`` (a run holds at
    least one item): how the data-parallel engine cuts its buckets, shared with the runtime."""
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for n in sizes:
        if cur and size + n > cap:
            out.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += n
    if cur:
        out.append(cur)
    return out


def _state_key(par: ParallelConfig) -> ParallelConfig:
    """``par`` without the fields model states do not depend on (a cache key)."""
    return replace(par, recompute="none", micro_batches=1, sequence_parallel=False,
                   overlap=True, cp_mode="ring",
                   schedule=(par.schedule if par.schedule in V_SCHEDULES else
                             "interleaved" if par.virtual_stages > 1 else "1f1b"))


def buckets(m: ModelConfig, par: ParallelConfig, pp_rank: int = 0) -> list[Bucket]:
    raw = _buckets(m, _state_key(par), pp_rank)
    if par.zero_align == "rows" and par.zero:  # shards on whole rows (fived.ledger.optimizers)
        obs = opt_buckets(m, _state_key(par), pp_rank, raw)
        return [replace(b, aligned=ob.padded) if b.shards > 1 else b for b, ob in zip(raw, obs)]
    return list(raw)


@lru_cache(maxsize=8192)
def _buckets(m: ModelConfig, par: ParallelConfig, pp_rank: int) -> tuple[Bucket, ...]:
    """The engine's flat buckets, in launch order (``fived.parallel.data``): parameters in
    reverse registration order, split by reduction group, then (ZeRO 0–2) into runs of at most
    ``bucket_mb`` MiB of gradient; ZeRO-3 makes one bucket per (block, group), last block first,
    then the root (embedding, final norm, head). The runs (``_bucket_runs``) do not depend on
    dp, cp, hybrid sharding or the ZeRO stage below 3: the search shares them."""
    sizes = group_sizes(par)

    def shards(g: str) -> int:
        return sizes[g] if par.zero and sizes[g] > 1 else 1

    runs = _bucket_runs(m, replace(par, dp=1, cp=1, dp_shard=0, dp_replicate=0,
                                   zero=_runs_zero(par)), pp_rank)
    return tuple(Bucket(g, n, shards(g), u, fp8=f, fp8_amax=a) for g, n, u, f, a in runs)


def _runs_zero(par: ParallelConfig) -> int:
    """The ZeRO stage the bucket runs depend on: 3 (per unit), 1 for ZeRO-1/2 with the fp8
    gather (the fp8 weights cut apart), else 0 (the stages below 3 lay out alike)."""
    from .params import fp8_gather

    return 3 if par.zero == 3 else 1 if par.zero and fp8_gather(par) else 0


def embed_bucket(m: ModelConfig, par: ParallelConfig, pp_rank: int = 0) -> Bucket | None:
    """The embedding's own bucket on a rank of the embedding group (the embedding held by two
    pipeline ranks, ``params.embed_copies``); None elsewhere."""
    from .params import alone, embed_copies, holds_embedding, param_list

    if embed_copies(m, par) < 2 or not holds_embedding(m, par, pp_rank):
        return None
    key = _state_key(par)
    plist = list(reversed(param_list(m, key, pp_rank)))
    runs = _bucket_members(m, replace(key, dp=1, cp=1, dp_shard=0, dp_replicate=0,
                                      zero=_runs_zero(par)), pp_rank, plist)
    i = next(i for i, (_, _, ks) in enumerate(runs) if alone(m, par, plist[ks[0]][0]))
    return buckets(m, par, pp_rank)[i]


@lru_cache(maxsize=1024)
def _bucket_runs(m: ModelConfig, par: ParallelConfig, pp_rank: int
                 ) -> tuple[tuple[str, int, int, int, int], ...]:
    """(group, elements, ZeRO-3 unit, fp8-gathered weights, their tile amaxes) of each of
    ``_buckets``' buckets, in launch order."""
    from .params import fp8_gather, fp8_weight, param_list

    plist = list(reversed(param_list(m, par, pp_rank)))
    gather8 = fp8_gather(par)

    def amaxes(k: int) -> int:
        return fp8_amax_count(par.fp8, m.hidden, plist[k][1]) if gather8 and fp8_weight(
            plist[k][0]) else 0
    return tuple((g, sum(plist[k][1] for k in ks), u,
                  sum(fp8_weight(plist[k][0]) for k in ks) if gather8 else 0,
                  sum(amaxes(k) for k in ks))
                 for g, u, ks in _bucket_members(m, par, pp_rank, plist))


def fp8_amax_count(recipe: str, hidden: int, numel: int) -> int:
    """The tile amaxes ZeRO-3's fp8 gather reduces per step for one fp8 weight of ``numel``
    elements (``fived.parallel.data.fp8``): every fp8 linear has the hidden size on one side
    (q/k/v/gate/up and the experts' w1/w3 read it, o/down/w2 write it), the other side is
    numel/h; tensorwise 1, rowwise N + K, blockwise ⌈N/128⌉·⌈K/128⌉."""
    other = numel // hidden
    assert other * hidden == numel, (numel, hidden)
    if recipe == "rowwise":
        return hidden + other
    if recipe == "blockwise":
        return -(-hidden // 128) * -(-other // 128)
    return 1


def _bucket_members(m: ModelConfig, par: ParallelConfig, pp_rank: int,
                    plist: list[tuple[str, int, bool]]) -> list[tuple[str, int, list[int]]]:
    """(group, ZeRO-3 unit, indexes into ``plist``) of every bucket, in launch order, as the
    engine lays them out (``fived.parallel.data.layout``): ``plist`` (arrival order) by unit
    (ZeRO-3: the last first, the root last; else one), each by group in order of first
    parameter, each cut around a parameter that is a bucket of its own (``params.alone``: the
    embedding group's copies), each run then split at ``bucket_mb`` (ZeRO-3: not split; with
    the fp8 gather, ``params.fp8_gather``, into the fp8 linears' weights, then the rest)."""
    from .params import alone, fp8_gather, fp8_weight

    units: dict[int, list[int]] = {}
    unit = zero3_unit(m, par, pp_rank) if par.zero == 3 else (lambda name: -1)
    for k, (name, _, _) in enumerate(plist):
        units.setdefault(unit(name), []).append(k)
    order = sorted((u for u in units if u >= 0), reverse=True) + ([-1] if -1 in units else [])
    cap = max(1, int(par.bucket_mb * 2**20 / grad_bytes(par)))
    out: list[tuple[str, int, list[int]]] = []
    for u in order:
        groups: dict[str, list[int]] = {}
        for k in units[u]:
            groups.setdefault("expert" if plist[k][2] else "dense", []).append(k)
        for g, ks in groups.items():
            runs: list[list[int]] = [[]]
            for k in ks:
                if alone(m, par, plist[k][0]):
                    runs += [[k], []]
                else:
                    runs[-1].append(k)
            for run in (r for r in runs if r):
                if par.zero == 3 and fp8_gather(par):
                    f8 = [k for k in run if fp8_weight(plist[k][0])]
                    rest = [k for k in run if not fp8_weight(plist[k][0])]
                    out += [(g, u, r) for r in (f8, rest) if r]
                    continue
                if par.zero == 3:
                    out.append((g, u, run))
                    continue
                start = 0
                for piece in split_sizes([plist[k][1] for k in run], cap):
                    cut = run[start:start + len(piece)]
                    start += len(piece)
                    if par.zero and fp8_gather(par):  # ZeRO-1/2: each piece's fp8 weights apart
                        f8 = [k for k in cut if fp8_weight(plist[k][0])]
                        rest = [k for k in cut if not fp8_weight(plist[k][0])]
                        out += [(g, u, r) for r in (f8, rest) if r]
                    else:
                        out.append((g, u, cut))
    return out


def model_states(m: ModelConfig, par: ParallelConfig, pp_rank: int = 0, dense_index: int = 0,
                 expert_index: int = 0, optimizer: str = "adamw") -> dict[str, float]:
    """Bytes of params, grads, master, optimizer, buffers, padding on one rank — what the
    runtime's ``engine.memory()`` reports from its tensors. Each key counts the tensors as held
    (padded flat buffers and equal shards); ``padding`` is the padding's share of them (a full
    buffer's pad, a shard's pad/N), so that a rank's keys = formula(Ψ) + padding.
    ``buffers`` (transient full gradient buffers of ZeRO-2, gathered ZeRO-3 units) is the
    engine's measured peak and is predicted as 0 here; ``comm_buffers`` estimates it.
    ``optimizer``: the ``--optimizer`` whose state is counted (``fived.ledger.optimizers``);
    ``dense_index``/``expert_index``: the rank's place in its groups (Muon's AdamW state is
    the owned elements of the embedding, head and norms, which depends on the shard)."""
    out = dict(_model_states(m, _state_key(par), pp_rank, optimizer))
    if optimizer != "adamw":
        obs = opt_buckets(m, _state_key(par), pp_rank, tuple(buckets(m, par, pp_rank)))
        out["optimizer"] = optimizer_state_bytes(obs, par, optimizer, dense_index, expert_index)
    return out


@lru_cache(maxsize=8192)
def _model_states(m: ModelConfig, par: ParallelConfig, pp_rank: int,
                  optimizer: str = "adamw") -> tuple:
    pb, gb, mb = param_bytes(par), grad_bytes(par), master_bytes(par)
    flat = {"adamw": OPTIMIZER_BYTES, "rownorm": 4, "muon": 4}.get(optimizer, 0)
    z = par.zero
    out = {"params": 0, "grads": 0, "master": 0, "optimizer": 0, "buffers": 0, "padding": 0.0}
    for b in buckets(m, par, pp_rank):
        n = b.shards
        full = b.padded
        shard, pad = full // n, full - b.numel
        if z in (1, 2) and b.gathered_bytes_per_element:
            # the fp8 gather: the owned shard, the whole e4m3 cast and its tile scales; its
            # gradient, master and optimizer state as every ZeRO-1/2 bucket's
            out["params"] += pb * shard + full + 4 * b.fp8_amax
            if pad:
                out["padding"] += pad * pb / n + pad
            pb_full = 0
        else:
            pb_full = pb
        p_full = z < 3
        g_full = z <= 1
        s_full = z == 0  # master and Adam state
        out["params"] += pb_full * (full if p_full else shard)
        out["grads"] += gb * (full if g_full else shard)
        out["master"] += mb * (full if s_full else shard)
        out["optimizer"] += OPTIMIZER_BYTES * (full if s_full else shard)
        if pad:
            for per, is_full in ((pb_full, p_full), (gb, g_full), (mb, s_full), (flat, s_full)):
                if per:
                    out["padding"] += pad * per if is_full else pad * per / n
    return tuple(out.items())


def checkpoint_bytes(m: ModelConfig, dtype_bytes: int = 2) -> int:
    """Weights only (what a bf16 checkpoint for inference holds)."""
    from .params import total_params

    return total_params(m) * dtype_bytes


# ------------------------------------------------------------------------ activations
@dataclass(frozen=True)
class ActivationOptions:
    attention: str = "flash"  # flash | materialised
    kv_repeat: bool = False  # K/V repeated to the query heads before attention
    fused_norm: bool = True  # RMSNorm saves only its input and rsqrt (fived runtime, fused
    # kernels); False: eager fp32 math, which also keeps the fp32 copies
    doc_mask: bool = False  # --doc-mask: per-row RoPE tables, the varlen core's indexes


EAGER = ActivationOptions()  # what the fived runtime saves (tests measure it)
FUSED = ActivationOptions("flash", kv_repeat=False, fused_norm=True)  # GPU kernels (planner)


def norm_bytes_per_token(h: int, e: int, fused: bool) -> float:
    """One RMSNorm's saved bytes per token, its output included (the next linear saves it):
    eager fp32 math saves the fp32 input copy, the fp32 normalised tensor, the output and the
    fp32 rsqrt (8h + e·h + 4); a fused kernel the input, the output and the rsqrt (2e·h + 4)."""
    return (2 * e * h + 4) if fused else (8 * h + e * h + 4)


def layer_activations(m: ModelConfig, par: ParallelConfig, micro_batch: int,
                      opts: ActivationOptions = EAGER) -> dict[str, float]:
    """Bytes one transformer block saves for backward, for ``micro_batch`` sequences on one
    rank (before recompute). Keys are the terms of the module docstring."""
    e = act_bytes(par)
    tp, cp = par.tp, par.cp
    sp = par.sequence_parallel and tp > 1
    tokens = micro_batch * m.seq_len / cp
    # MLA: every head at d_q (v's own width: ``mla_activation_terms``)
    h, d = m.hidden, m.qk_head_dim
    kv_heads = m.heads if m.is_mla else m.kv_heads
    hq = m.heads * d / tp
    heads_local = m.heads / tp
    if opts.kv_repeat:
        hkv = hq
    else:
        hkv = kv_heads * d / min(tp, kv_heads)
    if cp > 1 and par.cp_mode == "ulysses":  # k, v enter the all-to-all replicated to
        # ulysses_kv_heads local heads when cp does not divide the local kv heads
        hkv = ulysses_kv_heads(m.heads // tp, max(1, kv_heads // tp), cp) * d
    norm_div = tp if sp else 1
    out = {  # under SP the column matmuls save the norm output's shard (counted in the norm)
        "norms": tokens * 2 * norm_bytes_per_token(h, e, opts.fused_norm) / norm_div,
        "qkv": tokens * e * (hq + 2 * hkv),
    }
    if opts.attention == "materialised":
        out["softmax"] = tokens * e * heads_local * m.seq_len
    else:  # the fp32 log-sum-exp per head, and the kernel's RNG seed and offset (2 + 1 uint64)
        out["softmax"] = tokens * 4 * heads_local + FLASH_RNG_BYTES
    if cp > 1 and par.cp_mode == "ring":  # the ring core saves q and K/V (kv heads, not
        # repeated) as fp32 copies and its fp32 log-sum-exp (``fived.ledger.context``); its
        # own kernel keeps no RNG state
        out["softmax"] = tokens * 4 * heads_local
        out["qkv"] = tokens * (4 * hq + 8 * kv_heads * d / min(tp, kv_heads))
    out["attn_out"] = tokens * e * hq
    if cp > 1 and par.cp_mode == "ulysses":  # the kernel keeps its head-sharded output, and
        # the all-to-alls' reorderings their index (full sequence, int64): q, k, v and out
        out["attn_out"] += tokens * e * hq
        out["ulysses_index"] = 4 * m.seq_len * 8.0
    if opts.doc_mask and not (cp > 1 and par.cp_mode in ("ring", "ring-latent")):
        out.update(doc_core_bytes(m, par, micro_batch))
    if m.qk_norm:
        out["qk_norm"] = tokens * qk_norm_bytes_per_token(m, par, e, opts.fused_norm)
    if m.is_mla:
        if mla_narrow_core(m, par, opts.doc_mask):  # v and the output at d_v
            out["qkv"] = tokens * e * heads_local * (2 * d + m.v_head_dim)
            out["attn_out"] = tokens * e * heads_local * m.v_head_dim
        elif cp > 1 and par.cp_mode == "ulysses" and m.v_head_dim != m.qk_head_dim:
            # the all-to-all's sequence-sharded output (padded to d_q) is cut to d_v and made
            # contiguous before o_proj, which saves that copy (``mla_activation_terms``): the
            # padded output itself is saved by nothing; the kernel's head-sharded one is
            out["attn_out"] -= tokens * e * hq
        for k, v in mla_activation_terms(m, par, e, opts.fused_norm, opts.doc_mask).items():
            out[k] = out.get(k, 0.0) + tokens * v
        if latent_ring(m, par):
            for k, v in latent_ring_terms(m, par, e).items():
                out[k] = out[k] + tokens * v if k == "mla_latent" else tokens * v
    if m.is_moe:
        # experts are whole on every tp rank (replicated), the shared expert is tp-cut
        out["mlp"] = tokens * 3 * e * m.expert_ffn * m.top_k / norm_div
        if m.shared_expert:
            out["mlp"] += tokens * 3 * e * m.shared_ffn / tp
            if m.shared_expert_gate:  # σ(w·x) (e) and the shared output (e·h) for the product
                out["mlp"] += tokens * e * (h + 1) / norm_div
        out["router"] = (tokens * moe_routing_bytes_per_token(m, par) / norm_div
                         + micro_batch * (m.experts + 1) * 4)  # per sequence: f (E), s (1)
    else:  # SwiGLU saves gate, up and the product (silu recomputed); GELU its input and output
        out["mlp"] = tokens * (3 if m.mlp == "swiglu" else 2) * e * m.ffn / tp
    recipe = getattr(par, "fp8", "none")
    if recipe in ("tensorwise", "blockwise") and m.is_moe:
        out.update(fp8_moe_saves(m, par, tokens, e, norm_div, recipe, out))
    elif recipe in ("tensorwise", "blockwise"):
        out.update(fp8_layer_saves(m, par, tokens, e, norm_div, recipe, out))
    elif recipe == "rowwise" and sp and not m.is_moe:  # the gathered inputs, in e bytes
        out["norms"] -= tokens * 2 * e * h / norm_div
        out["fp8_inputs"] = tokens * 2 * e * h
    return out


def doc_core_bytes(m: ModelConfig, par: ParallelConfig, micro_batch: int) -> dict[str, float]:
    """What the per-document varlen core (``--doc-mask``, ``fived.model.layers.doc_attention``:
    one rank, tp, pp, Ulysses) saves beyond the causal core, per layer, for rows that hold more
    than one document (a batch whose every row is one document runs the causal core itself):
    the scatter of the segments' outputs back into the rows keeps two int64 indexes per token
    of the rows it attends over (the whole sequence, Ulysses' too): 16·b·S; and where the next
    matmul keeps the scattered output (not under Ulysses, whose all-to-all keeps nothing) the
    segments' own outputs, which their kernels saved, are a second copy: b·S·e·heads·d/tp. The
    ring keeps the rows' ids on its autograd context (not a saved tensor) and saves nothing
    more."""
    e = act_bytes(par)
    rows = micro_batch * m.seq_len
    out = {"doc_index": rows * 16.0}
    if par.cp == 1:
        out["doc_out"] = rows * e * m.heads * m.head_dim / par.tp
    return out


def fp8_copy_bytes(tokens: float, k: float, recipe: str) -> float:
    """One linear input of ``tokens`` rows of width ``k`` saved as fp8 with its scales."""
    if recipe == "blockwise":
        return tokens * (k + 4 * math.ceil(k / 128))
    return tokens * k + 4


def fp8_column_cast_bytes(tokens: float, k: float, recipe: str) -> float:
    """A ``tokens`` × ``k`` operand cast column-wise for a weight gradient (its transposed
    e4m3 cast): one scale (tensorwise), one per column (rowwise) or per 128×1 tile along the
    tokens (blockwise)."""
    scales = {"tensorwise": 4.0, "rowwise": 4.0 * k,
              "blockwise": 4.0 * k * math.ceil(tokens / 128)}
    return tokens * k + scales.get(recipe, 0.0)


def fp8_layer_saves(m: ModelConfig, par: ParallelConfig, tokens: float, e: int, norm_div: int,
                    recipe: str, out: dict[str, float]) -> dict[str, float]:
    """The terms a dense block's fp8 linears change (module docstring): the norm outputs and
    the SwiGLU product leave, the four fp8 copies come."""
    tp = par.tp
    h, f, hq = m.hidden, m.ffn / tp, m.attn_dim / tp
    res = {"norms": out["norms"] - tokens * 2 * e * h / norm_div,
           "mlp": out["mlp"] - tokens * e * f,
           "fp8_inputs": (2 * fp8_copy_bytes(tokens, h, recipe) + fp8_copy_bytes(tokens, hq, recipe)
                          + fp8_copy_bytes(tokens, f, recipe)),
           **fp8_ulysses_out(m, par, tokens, e, out)}
    res.update(fp8_mla_attention(m, par, tokens, e, norm_div, recipe, {**out, **res}))
    return res


def fp8_mla_attention(m: ModelConfig, par: ParallelConfig, tokens: float, e: int, norm_div: int,
                      recipe: str, out: dict[str, float]) -> dict[str, float]:
    """MLA's attention under fp8 (the terms ``fp8_layer_saves`` / ``fp8_moe_saves`` set, put
    right): only o_proj is an fp8 linear (``fived.ledger.params.FP8_LINEARS``; the down- and
    up-projections run in the compute dtype), so the block norm's output stays saved (by the
    down-projections, e·h) and no fp8 copy of it comes; where the core pads v
    (``mla_narrow_core`` false), o_proj keeps its fp8 copy of the cut output instead of the
    d_v copy in the compute dtype (e·(H/tp)·d_v leaves ``attn_out``)."""
    if not m.is_mla:
        return {}
    res = {"norms": out["norms"] + tokens * e * m.hidden / norm_div,
           "fp8_inputs": out["fp8_inputs"] - fp8_copy_bytes(tokens, m.hidden, recipe)}
    if m.v_head_dim != m.qk_head_dim and not mla_narrow_core(m, par):
        res["attn_out"] = out["attn_out"] - tokens * e * m.heads / par.tp * m.v_head_dim
    return res


def fp8_ulysses_out(m: ModelConfig, par: ParallelConfig, tokens: float, e: int,
                    out: dict[str, float]) -> dict[str, float]:
    """Under Ulysses the attention output is two tensors: the kernel's head-sharded output
    (its save) and the all-to-all's sequence-sharded one (wo's input, saved by wo in e bytes).
    An fp8 wo saves its fp8 copy instead (in ``fp8_inputs``), so ``attn_out`` keeps only the
    kernel's, e·hq per token."""
    if par.cp > 1 and par.cp_mode == "ulysses" and not m.is_mla:
        return {"attn_out": out["attn_out"] - tokens * e * m.attn_dim / par.tp}
    return {}


def fp8_moe_saves(m: ModelConfig, par: ParallelConfig, tokens: float, e: int, norm_div: int,
                  recipe: str, out: dict[str, float]) -> dict[str, float]:
    """The terms a MoE block's fp8 linears change (the experts a loop of fp8 linears,
    ``fived.parallel.fp8``): attention as in a dense block (the input norm's output leaves, the
    fp8 copies of q/k/v's and wo's inputs come); each local expert saves its routed rows as one
    fp8 copy (w1 and w3 share it) and its SwiGLU product as another (w2's), so the permuted rows
    (e·h·k per token, in ``router``) and the products (e·f_e·k, in ``mlp``) leave and k·(h + f_e)
    bytes per token come, with the scales: tensorwise 4 B per copy and local expert (E/ep of
    them, each called once per micro-batch, an expert without rows too), blockwise 4 per 128-wide
    tile of each row. A shared expert is a dense MLP: its product leaves for an fp8 copy, and its
    input (the norm output) for one fp8 copy — the norm output then stays saved only where
    something else keeps it (the router's fp32 input in fp32, the shared-expert gate)."""
    tp, h, k = par.tp, m.hidden, m.top_k
    hq, fe = m.attn_dim / tp, m.expert_ffn
    routed = tokens * k / norm_div  # rows through the local experts (uniform routing)
    local = m.experts // max(1, par.ep)
    if recipe == "blockwise":
        experts8 = routed * (h + 4 * math.ceil(h / 128) + fe + 4 * math.ceil(fe / 128))
    else:
        experts8 = routed * (h + fe) + 2 * 4 * local
    res = {"norms": out["norms"] - tokens * e * h / norm_div,
           "router": out["router"] - routed * e * h,
           "mlp": out["mlp"] - routed * e * fe,
           "fp8_inputs": (fp8_copy_bytes(tokens, h, recipe) + fp8_copy_bytes(tokens, hq, recipe)
                          + experts8),
           **fp8_ulysses_out(m, par, tokens, e, out)}
    res.update(fp8_mla_attention(m, par, tokens, e, norm_div, recipe, {**out, **res}))
    if m.shared_expert:
        fs = m.shared_ffn / tp
        res["mlp"] -= tokens * e * fs
        res["fp8_inputs"] += fp8_copy_bytes(tokens, h, recipe) + fp8_copy_bytes(tokens, fs, recipe)
        if e != 4 and not m.shared_expert_gate:  # nothing else keeps the norm output
            res["norms"] -= tokens * e * h / norm_div
    return res


def qk_norm_bytes_per_token(m: ModelConfig, par: ParallelConfig, e: int, fused: bool) -> float:
    """What the q and k norms (``qk_norm``) of one layer save per token on one tp rank: each
    head's input (e·d; eager fp32 math: its fp32 copy and the normalised tensor, 8·d) and its
    fp32 1/rms (4), for the rank's heads/tp query and kv_heads/min(tp, kv_heads) kv heads."""
    heads = m.heads / par.tp + m.kv_heads / min(par.tp, m.kv_heads)
    return heads * ((e if fused else 8) * m.head_dim + 4)


def mla_narrow_core(m: ModelConfig, par: ParallelConfig, doc_mask: bool = False) -> bool:
    """Whether MLA's core keeps v and its output at d_v (``fived.model.mla.NarrowVFlash``):
    its own core (no context parallelism) without document masks, when d_v < d_q. Otherwise
    the core takes v padded to d_q and o_proj keeps a d_v copy of the cut output."""
    return (m.is_mla and m.v_head_dim != m.qk_head_dim and par.cp == 1 and not doc_mask)


def mla_activation_terms(m: ModelConfig, par: ParallelConfig, e: int, fused: bool,
                         doc_mask: bool = False) -> dict[str, float]:
    """What multi-head latent attention (``fived.model.mla``) saves per token on one rank
    beyond the core's q, k, v, output and log-sum-exp — q and k at d_q; v and the output at
    d_v with MLA's own core (``mla_narrow_core``), at d_q (padded) under context parallelism
    or document masks — which ``layer_activations`` counts with kv heads = heads:

    * ``mla_latent``: the query latent W_qa·x (the latent norm's input) and the norm's output
      (saved by W_qb) with its fp32 1/rms: 2e·r_q + 4 (none without query compression: q_proj
      saves x, the block norm's output); the joint down-projection's output, whose latent part
      its norm saves (the storage holds the rotary key's d_r too): e·(r_kv + d_r), the norm's
      output e·r_kv and its 1/rms 4. Whole on every tp rank (the down-projections are
      replicated); under SP a sequence shard (÷ tp). Eager fp32 norm math (``fused`` False)
      keeps the fp32 copies too (+ 8·r − e·r per norm).
    * ``attn_out``: o_proj's input, the padded core's output cut back to d_v and made
      contiguous, e·(H/tp)·d_v — a copy only when the core pads v (otherwise the core's
      output itself)."""
    tp = par.tp
    sp = par.sequence_parallel and tp > 1

    def norm(r: int) -> float:
        return (e * r + 4) if fused else (8 * r + 4)

    q = (e * m.q_lora_rank + norm(m.q_lora_rank)) if m.q_lora_rank else 0.0
    kv = e * (m.kv_lora_rank + m.qk_rope_head_dim) + norm(m.kv_lora_rank)
    out = {"mla_latent": (q + kv) / (tp if sp else 1)}
    if m.v_head_dim != m.qk_head_dim and not mla_narrow_core(m, par, doc_mask):
        out["attn_out"] = e * m.heads / tp * m.v_head_dim
    return out


def latent_ring(m: ModelConfig, par: ParallelConfig) -> bool:
    """Whether MLA's attention runs on the latent ring (``--cp-mode ring-latent``)."""
    return m.is_mla and par.cp > 1 and par.cp_mode == "ring-latent"


def latent_ring_terms(m: ModelConfig, par: ParallelConfig, e: int,
                      checkpointed: bool = False) -> dict[str, float]:
    """What MLA saves per token under the latent ring (``fived.parallel.context.LatentRing``),
    the terms replacing ``layer_activations``'s: the ring saves q (fp32, H/tp heads at d_q),
    the local latent [c ; kᴿ] (fp32, r_kv + d_r, whole on every tp rank and over the rank's
    whole sequence), its fp32 log-sum-exp (H/tp) and its output at d_v (o_proj's input, e);
    W_kvb is not called on the latent, so the latent norm's output (e·r_kv, a sequence shard
    under SP) is not kept (``mla_latent``: what comes off that term). ``checkpointed``
    (selective recompute): the checkpoint keeps the core's inputs instead, q and the latent
    at e, and no log-sum-exp."""
    heads = m.heads / par.tp
    sp = par.sequence_parallel and par.tp > 1
    width = m.kv_lora_rank + m.qk_rope_head_dim
    norm_out = e * m.kv_lora_rank / (par.tp if sp else 1)
    lat = {"qkv": (e if checkpointed else 4) * (heads * m.qk_head_dim + width),
           "softmax": 0.0 if checkpointed else 4 * heads,
           "attn_out": e * heads * m.v_head_dim}
    lat["mla_latent"] = -norm_out  # a change to ``mla_activation_terms``' term, not a value
    return lat


FLASH_RNG_BYTES = 24  # what torch's flash attention saves besides its outputs: (2,) + () uint64


def moe_routing_bytes_per_token(m: ModelConfig, par: ParallelConfig) -> float:
    """What one MoE layer's routing saves per token (``fived.model.moe.MoE.moe``), measured
    tensor by tensor (the dry run's MoE check): router probabilities and logits (4E + 4E, the
    logits for the z-loss), log-sum-exp 4, top-k ids 8k, top-k probabilities, their sum and the
    normalised weights (fp32) 4k + 4 + 4k, the two permutation indices 16k, the permuted rows
    e·h·k (the experts' input, once), the experts' outputs e·h·k (the weighted combine keeps
    them once and rebuilds the un-permuted slots in backward, ``moe._Combine``); in bf16/fp16
    the fp32 copy of the input the router reads (4h) instead of the input (e·h, in the norm
    term); with ep > 1 the dispatch's local order and its inverse 16k — or, with the token
    dispatch (``ep_dispatch = tokens``), its local order 8k, the received fp32 weights 4k and
    the D = ``ep_destinations_bound`` token indices 8D, the combine then keeping no weights
    (− 4k): 8k + 8D in all."""
    e, h, k, E = act_bytes(par), m.hidden, m.top_k, m.experts
    out = 8 * E + 4 + 8 * k + 4 * k + 4 + 4 * k + 16 * k + 2 * e * h * k
    if e != 4:  # the router saves an fp32 copy of its input; without a shared expert nothing
        out += 4 * h - (0 if m.shared_expert else e * h)  # saves the input itself (the norm
        # term counts it as saved by the next matmul)
    if par.ep > 1 and par.ep_dispatch == "tokens":
        out += 8 * k + 8 * ep_destinations_bound(m, par)
    elif par.ep > 1:
        out += 16 * k
    return float(out)


def selective_layer(m: ModelConfig, par: ParallelConfig, micro_batch: int,
                    opts: ActivationOptions = EAGER) -> dict[str, float]:
    """The block under selective recompute: the attention core is recomputed."""
    out = layer_activations(m, par, micro_batch, opts)
    e = act_bytes(par)
    tokens = micro_batch * m.seq_len / par.cp
    d = m.qk_head_dim
    kv_heads = m.heads if m.is_mla else m.kv_heads
    hq = m.heads * d / par.tp
    hkv = kv_heads * d / min(par.tp, kv_heads)
    out["qkv"] = tokens * e * (hq + 2 * hkv)
    if mla_narrow_core(m, par, opts.doc_mask):  # the checkpoint keeps v at d_v
        out["qkv"] = tokens * e * m.heads / par.tp * (2 * d + m.v_head_dim)
    out["softmax"] = 0.0
    out.pop("doc_index", None)  # --doc-mask: the varlen core's saves are recomputed too
    out.pop("doc_out", None)
    if m.is_mla and m.v_head_dim != m.qk_head_dim:  # the core's d_v output (or o_proj's
        out["attn_out"] = tokens * e * m.heads / par.tp * m.v_head_dim  # copy of the cut one)
    if par.cp > 1 and par.cp_mode == "ulysses":  # the core's all-to-alls are recomputed too
        out["attn_out"] = tokens * e * hq
        out["ulysses_index"] = 0.0
    if getattr(par, "fp8", "none") in ("tensorwise", "blockwise") and not m.is_mla:
        out["attn_out"] = 0.0  # the core's output is wo's input, which wo saves as fp8
    if latent_ring(m, par):  # the checkpoint keeps q and the latent
        for k, v in latent_ring_terms(m, par, e, checkpointed=True).items():
            if k != "mla_latent":
                out[k] = tokens * v
    return out


def block_input_bytes(m: ModelConfig, par: ParallelConfig, micro_batch: int) -> float:
    sp = par.sequence_parallel and par.tp > 1
    return micro_batch * m.seq_len / par.cp * act_bytes(par) * m.hidden / (par.tp if sp else 1)


def recompute_layer_bytes(m: ModelConfig, par: ParallelConfig, micro_batch: int,
                          opts: ActivationOptions = EAGER) -> float:
    """What ``--recompute full`` re-materialises of one block in its backward: the block's
    saves (``layer_activations``) less its input, which the checkpoint holds already and the
    first norm saves as that same tensor (a fused norm saves its input itself)."""
    shared = block_input_bytes(m, par, micro_batch) if opts.fused_norm else 0.0
    return sum(layer_activations(m, par, micro_batch, opts).values()) - shared


def stage_extra_activations(m: ModelConfig, par: ParallelConfig, micro_batch: int, first: bool,
                            last: bool, opts: ActivationOptions = EAGER) -> dict[str, float]:
    """Token ids on the first stage; final norm, the loss's logits and targets on the last."""
    e = act_bytes(par)
    tokens = micro_batch * m.seq_len / par.cp
    sp = par.sequence_parallel and par.tp > 1
    out: dict[str, float] = {}
    # RoPE cos/sin tables (the compute dtype, s_local × d/2 each), one pair per forward, shared
    # by every layer of the chunk
    out["rope_tables"] = m.seq_len / par.cp * m.rope_dim * e
    if opts.doc_mask:  # per-row positions (fived.model.documents): a pair of tables per row
        out["rope_tables"] *= micro_batch
        if par.recompute == "selective":  # the recomputed core's input: the rows' ids (int64)
            out["doc_ids"] = micro_batch * m.seq_len * 8.0
    if first:
        out["token_ids"] = tokens * 8
    if last:
        out["final_norm"] = tokens * norm_bytes_per_token(m.hidden, e, opts.fused_norm) / (
            par.tp if sp else 1)
        # the loss keeps the logits in the compute dtype and two (tp: the max and the sum of
        # exponentials) or one (the log-sum-exp) fp32 numbers per token
        out["logits"] = tokens * (e * m.vocab / par.tp + (8 if par.tp > 1 else 4))
        # the targets (int64); under tp their local index and an "inside this slice" bool
        out["targets"] = tokens * (8 + (1 if par.tp > 1 else 0))
        if m.mtp_depth:
            out["mtp"] = sum(mtp_activations(m, par, micro_batch, opts).values())
    return out


def mtp_activations(m: ModelConfig, par: ParallelConfig, micro_batch: int,
                    opts: ActivationOptions = EAGER) -> dict[str, float]:
    """What the D multi-token prediction modules save per micro-batch on the last stage, per
    module: the shifted token ids (int64); enorm and hnorm (input, output, 1/rms — hnorm's
    input is the previous head's input, already saved); the block (by the recompute mode);
    the output norm; its logits, loss numbers and targets (as the trunk's head)."""
    e = act_bytes(par)
    tokens = micro_batch * m.seq_len / par.cp
    sp_div = par.tp if (par.sequence_parallel and par.tp > 1) else 1
    norm = tokens * norm_bytes_per_token(m.hidden, e, opts.fused_norm) / sp_div
    out = {"token_ids": 0.0, "norms": 0.0, "blocks": 0.0, "logits": 0.0, "targets": 0.0}
    for k in range(m.mtp_depth):
        c = layer_cfg(m, m.layers + k)
        out["token_ids"] += tokens * 8
        out["norms"] += 3 * norm - tokens * e * m.hidden / sp_div
        if par.recompute == "full":
            out["blocks"] += block_input_bytes(m, par, micro_batch)
        else:
            fn = selective_layer if par.recompute == "selective" else layer_activations
            out["blocks"] += sum(fn(c, par, micro_batch, opts).values())
        out["logits"] += tokens * (e * m.vocab / par.tp + (8 if par.tp > 1 else 4))
        out["targets"] += tokens * (8 + (1 if par.tp > 1 else 0))
    return out


@lru_cache(maxsize=16384)
def stage_activation_bytes(m: ModelConfig, par: ParallelConfig, micro_batch: int, stage: int,
                           opts: ActivationOptions = EAGER) -> float:
    """What one micro-batch leaves saved on (virtual) stage ``stage`` after its forward: its
    blocks (by the recompute mode) and the stage's extras (token ids, RoPE tables, the last
    stage's final norm, logits and targets)."""
    n_stages = par.pp * max(1, par.virtual_stages)
    ids = stage_layers(m, par)[stage]
    if par.recompute == "full":
        total = len(ids) * block_input_bytes(m, par, micro_batch)
    else:
        fn = selective_layer if par.recompute == "selective" else layer_activations
        total = sum(n * sum(fn(c, par, micro_batch, opts).values())
                    for c, n in layer_kinds(m, ids) if n)
    extra = stage_extra_activations(m, par, micro_batch, stage == 0, stage == n_stages - 1, opts)
    return total + sum(extra.values())


def inflight_microbatches(par: ParallelConfig, pp_rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank ``pp_rank`` holds at its peak."""
    p, mb = par.pp, par.micro_batches
    if p == 1:
        return 1.0
    if par.schedule == "gpipe":
        return float(mb)
    if par.schedule == "zb-v":  # chunk-micro-batches live at the peak, over the 2 chunks
        return min(2 * p, mb + 1 + pp_rank, 2 * mb) / 2
    if par.schedule == "dualpipe-v":
        return (2 * p + 1) / 2
    if par.schedule == "interleaved" and par.virtual_stages > 1:
        v = par.virtual_stages
        chunks = 2 * (p - pp_rank - 1) + (v - 1) * p + 1
        return min(chunks / v, float(mb))
    return float(min(p - pp_rank, mb))


@lru_cache(maxsize=1024)
def _compute_orders(name: str, pp: int, m: int, v: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    sched = schedules.build(name, pp, m, v)
    return tuple(tuple((a.kind, a.mb, a.stage) for a in sched.compute(r)) for r in range(pp))


def schedule_actions(par: ParallelConfig, pp_rank: int = 0) -> list[tuple[str, int, int]]:
    """The compute actions (kind, micro-batch, stage) pipeline rank ``pp_rank`` runs in one
    step, in order: the executor's own lists (``fived.schedules``); without pp, F and B of
    each micro-batch in turn."""
    if par.pp == 1:
        return [(k, i, 0) for i in range(par.micro_batches) for k in ("F", "B")]
    name, pp, m, v = _schedule_key(par)
    return list(_compute_orders(name, pp, m, v)[pp_rank])


def _schedule_key(par: ParallelConfig) -> tuple[str, int, int, int]:
    """(schedule name, pp, micro-batches, chunks per rank) of ``fived.schedules.build``."""
    v = 2 if par.schedule in V_SCHEDULES else max(1, par.virtual_stages)
    name = "interleaved" if v > 1 and par.schedule not in V_SCHEDULES else par.schedule
    return name, par.pp, par.micro_batches, v


def fused_backwards(par: ParallelConfig, pp_rank: int = 0) -> frozenset[tuple[int, int]]:
    """(micro-batch, stage) whose B the executor runs as one ordinary backward with its W: the
    B directly followed by its own W in the rank's action list, sends included (DualPipe-V's
    BW; a first stage's B, which sends nothing), unless only one of the two is its stage's
    last (``fived.parallel.pipeline.runtime``)."""
    if par.pp == 1:
        return frozenset()
    return _fused_backwards(*_schedule_key(par), pp_rank)


@lru_cache(maxsize=1024)
def _fused_backwards(name: str, pp: int, m: int, v: int, pp_rank: int
                     ) -> frozenset[tuple[int, int]]:
    acts = schedules.build(name, pp, m, v).ranks[pp_rank]
    final = set()
    for kind in ("B", "W"):
        for st in {a.stage for a in acts}:
            idx = [i for i, a in enumerate(acts) if a.kind == kind and a.stage == st]
            if idx:
                final.add(idx[-1])
    return frozenset((a.mb, a.stage) for i, (a, b) in enumerate(zip(acts, acts[1:]))
                     if a.kind == "B" and (b.kind, b.mb, b.stage) == ("W", a.mb, a.stage)
                     and (i in final) == (i + 1 in final))


def receives_held(par: ParallelConfig, pp_rank: int = 0) -> tuple[int, ...]:
    """Per compute action of the rank (``schedule_actions``' order): the receive buffers
    alive beside the one it consumes — the executor's ``_P2P`` replayed: it posts one receive
    ahead per peer, takes each peer's messages in the peer's send order, and keeps those that
    arrive before they are wanted (interleaved: a peer's activations and gradients come in
    another order than the rank consumes them)."""
    if par.pp == 1:
        return tuple(0 for _ in schedule_actions(par, pp_rank))
    return _receives_held(*_schedule_key(par), pp_rank)


@lru_cache(maxsize=1024)
def _receives_held(name: str, pp: int, m: int, v: int, pp_rank: int) -> tuple[int, ...]:
    sched = schedules.build(name, pp, m, v)
    expected: dict[int, list] = {}
    for src, acts in enumerate(sched.ranks):
        if src != pp_rank:
            expected[src] = [schedules.message(a) for a in acts
                             if a.kind in ("SEND_F", "SEND_B")
                             and schedules.peer(a, sched) == pp_rank]
    nxt = dict.fromkeys(expected, 0)
    posted: dict[int, list] = {src: [] for src in expected}
    arrived: dict[int, set] = {src: set() for src in expected}

    def post(src: int) -> bool:
        if nxt[src] >= len(expected[src]):
            return False
        posted[src].append(expected[src][nxt[src]])
        nxt[src] += 1
        return True

    out = []
    for a in sched.ranks[pp_rank]:
        if a.kind in ("RECV_F", "RECV_B") and not schedules.is_local(a, sched):
            src, msg = schedules.peer(a, sched), schedules.message(a)
            while msg not in arrived[src]:
                if not posted[src]:
                    post(src)
                arrived[src].add(posted[src].pop(0))
            arrived[src].discard(msg)
            if not posted[src]:
                post(src)
        elif a.kind in schedules.COMPUTE:
            out.append(sum(len(posted[x]) + len(arrived[x]) for x in expected))
    return tuple(out)


def releases_at(par: ParallelConfig) -> str:
    """The action after which a micro-batch's saved activations are gone: B, or W for the
    V-shaped zero-bubble schedules (their B keeps what W needs). ZB-H1's B frees the graph;
    the inputs and output gradients its W needs are a transient of the peak
    (``fived.ledger.peak``)."""
    return "W" if par.schedule in V_SCHEDULES and par.pp > 1 else "B"


def inflight_by_stage(par: ParallelConfig, pp_rank: int, stage_bytes: dict[int, float]
                      ) -> dict[int, int]:
    """Micro-batches holding activations on each of the rank's stages at the moment their sum
    (weighted by ``stage_bytes``) is largest, replaying the rank's schedule: a forward adds a
    micro-batch to its stage, its release (``releases_at``) removes it. With stages of unequal
    size (405B interleaved, last rank: 4 + 3 layers and the logits) the worst moment is not the
    end of the warm-up."""
    free = releases_at(par)
    live = dict.fromkeys(stage_bytes, 0)
    best, at = -1.0, dict(live)
    for kind, _, st in schedule_actions(par, pp_rank):
        if kind == "F":
            live[st] += 1
            total = sum(stage_bytes[k] * n for k, n in live.items())
            if total > best:
                best, at = total, dict(live)
        elif kind == free:
            live[st] -= 1
    return at


def activations(m: ModelConfig, par: ParallelConfig, micro_batch: int, pp_rank: int = 0,
                opts: ActivationOptions = EAGER) -> dict[str, float]:
    """Activation bytes at the peak of one pipeline rank, by term (in-flight factor applied)."""
    stages = rank_stages(par, pp_rank)
    n_stages = par.pp * max(1, par.virtual_stages)
    split = stage_layers(m, par)
    layers = sum(len(split[k]) for k in stages)
    first, last = 0 in stages, n_stages - 1 in stages
    counts = inflight_by_stage(par, pp_rank, {
        st: stage_activation_bytes(m, par, micro_batch, st, opts) for st in stages})
    weights = [float(counts[st]) for st in stages]  # micro-batches in flight per chunk
    k = sum(weights) / len(stages)
    k_first = counts.get(0, k)
    k_last = counts.get(n_stages - 1, k)
    # micro-batch × layers held, by block shape (first_dense_layers: dense and MoE blocks)
    kinds: dict[ModelConfig, int] = {}
    for w, st in zip(weights, stages):
        for c, n in layer_kinds(m, split[st]):
            kinds[c] = kinds.get(c, 0) + w * n
    kinds = kinds or {m: 0}
    layer_mbs = sum(kinds.values())
    out: dict[str, float] = {}
    if par.recompute == "full":
        out["block_inputs"] = layer_mbs * block_input_bytes(m, par, micro_batch)
        out["recompute_layer"] = max(
            (recompute_layer_bytes(c, par, micro_batch, opts)
             for c, n in kinds.items() if n), default=0.0) if layers else 0.0
    else:
        fn = selective_layer if par.recompute == "selective" else layer_activations
        for c, mbs in kinds.items():
            for name, v in fn(c, par, micro_batch, opts).items():
                out[name] = out.get(name, 0.0) + mbs * v
    for name, v in stage_extra_activations(m, par, micro_batch, first, last, opts).items():
        if name in ("final_norm", "logits", "targets"):
            out[name] = k_last * v  # held by the last (virtual) stage
        elif name == "token_ids":
            out[name] = k_first * v
        elif name == "doc_ids":  # one storage, the rank's whole batch: each micro-batch's
            out[name] = par.micro_batches * v  # checkpoint keeps a view of it
        else:  # the RoPE tables: one pair per chunk forward in flight
            out[name] = sum(weights) * v
    return out


# ------------------------------------------------------------------------ buffers
def mlp_grad_ends(m: ModelConfig, par: ParallelConfig, pp_rank: int) -> tuple[int, ...]:
    """For each block of the rank, in the order their backwards run: how many gradients have
    arrived (reverse registration order) once its MLP (dense, shared expert, experts, router:
    the block's parameters before its post-attention norm) has all of its own. ``par``: the
    state layout (``_state_key``); the names do not depend on dp, cp or the ZeRO stage."""
    return _mlp_grad_ends(m, replace(par, dp=1, cp=1, dp_shard=0, dp_replicate=0, zero=0),
                          pp_rank)


@lru_cache(maxsize=1024)
def _mlp_grad_ends(m: ModelConfig, par: ParallelConfig, pp_rank: int) -> tuple[int, ...]:
    from .params import param_list

    ends: list[int] = []
    prev = False
    for seen, (name, _, _) in enumerate(reversed(param_list(m, par, pp_rank))):
        norm = "post_attention_layernorm" in name
        if norm and not prev:  # its weight (and bias): one end per block
            ends.append(seen)
        prev = norm
    return tuple(ends)


@lru_cache(maxsize=4096)
def arrival_runs(m: ModelConfig, par: ParallelConfig, pp_rank: int
                 ) -> tuple[tuple[int, int], ...]:
    """The gradients' arrival (reverse registration order) as runs (bucket index, count) of
    consecutive gradients into one bucket (``buckets``' order): a MoE rank's thousands of expert
    weights arrive a few runs per layer. Only a run's first gradient can gather a unit or
    allocate a buffer and only its last can free or launch one, so ``zero_buffer_peak``
    replays a run as one event. ``par``: the state layout (``_state_key``)."""
    from .params import param_list

    plist = list(reversed(param_list(m, par, pp_rank)))
    where: list[int] = [0] * len(plist)  # the bucket of each gradient, in arrival order
    for i, (_, _, ks) in enumerate(_bucket_members(m, par, pp_rank, plist)):
        for k in ks:
            where[k] = i
    runs: list[list[int]] = []
    for i in where:
        if runs and runs[-1][0] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    return tuple((i, k) for i, k in runs)


def zero_buffer_peak(m: ModelConfig, par: ParallelConfig, pp_rank: int = 0
                     ) -> tuple[int, int] | None:
    """``_zero_buffer_peak`` on a key without what the replay does not read (the planner
    tries each layout with several micro-batch sizes and recompute modes): micro-batches
    count only as 1, 2 or more (it replays the first, the second and the last)."""
    return _zero_buffer_peak(m, _zero_key(par), pp_rank)


def _zero_key(par: ParallelConfig) -> ParallelConfig:
    """``par`` without what the replay does not read; full recompute stays where rowwise's fp8
    gather carries both of W's casts in backward (``fived.parallel.data.fp8``)."""
    from .params import fp8_gather

    both = par.recompute == "full" and par.fp8 == "rowwise" and fp8_gather(par)
    return replace(par, recompute="full" if both else "none", sequence_parallel=False,
                   cp_mode="ring", micro_batches=min(par.micro_batches, 3))


@lru_cache(maxsize=4096)
def _zero_buffer_peak(m: ModelConfig, par: ParallelConfig, pp_rank: int = 0
                      ) -> tuple[int, int] | None:
    replay = _zero_replay(m, par, pp_rank)
    return None if replay is None else replay[:2]


@lru_cache(maxsize=4096)
def zero_moments(m: ModelConfig, par: ParallelConfig, pp_rank: int = 0
                 ) -> tuple[tuple[int, ...], int, tuple[int, ...], tuple[int, ...],
                            tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...],
                            tuple[tuple[int, ...], ...]] | None:
    """ZeRO-2/3's transient bytes (gradients + gathered parameters) at nine moments of the
    replay: the first gradient's arrival in each micro-batch's backward (micro-batches 0, 1
    and the last; the ones between replay the second's), the end of the last backward (what
    the reduction phase starts with), the end of each forward (ZeRO-3 without pp: the root
    gathered for the loss; else empty), the start of each backward (before any gradient:
    the loss's backward), the first block's MLP backward (its MLP's gradients in: a MoE
    block's expert bucket allocated beside its shared expert's and router's) and the first
    gradient of each backward (ZeRO-3 without pp: the head's, before the first block's unit
    is gathered; else the same as the first) and, ZeRO-3 without pp, the last block's
    forward (the root and that block gathered) and the one before it (the root, that block
    and the last one prefetched; both empty elsewhere), and each block's MLP backward in the
    order they run (per micro-batch: a tuple; the fifth is its first). None where the replay
    does not run."""
    replay = _zero_replay(m, _zero_key(par), pp_rank)
    return None if replay is None else replay[2:]


@lru_cache(maxsize=4096)  # one replay serves zero_buffer_peak and zero_moments (same key)
def _zero_replay(m: ModelConfig, par: ParallelConfig, pp_rank: int = 0
                 ) -> tuple[int, int, tuple[int, ...], int, tuple[int, ...], tuple[int, ...],
                            tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...],
                            tuple[tuple[int, ...], ...]] | None:
    """(full-gradient bytes, gathered-parameter bytes) at the peak of ZeRO-2/3's transient
    buffers, from a replay of the engine's lifecycle (``fived.parallel.data``: ``Zero2``,
    ``Zero3``) on the ledger's buckets; None where it is not replayed (ZeRO-2/3 with more than
    one pipeline chunk per rank: the schedule's order of the chunks' backwards decides).

    The replay, per micro-batch (gradients arrive in reverse registration order, the order the
    engine lays its buckets out in):

    * ZeRO-3 forward (pp = 1): gather the root, prefetch block 0; before block i gather it and
      prefetch block i+1, free it after; the root stays gathered. Backward: prefetch
      the last block; at a block's first gradient gather it and prefetch the one before; a
      unit is freed when its last gradient is in (the root at the embedding's, the last).
      With pp the rank's one chunk is gathered around every F and B (per step: all step),
      so it is whole whenever a gradient arrives.
    * a bucket's full gradient buffer is allocated at its first gradient (any micro-batch);
      on the last micro-batch a bucket launches when it and every earlier bucket of its group
      (dense, expert: each its own launch sequence) are complete, and the k-th launch of a
      group waits for the (k−2)-th, releasing its buffer (at most two in flight per group);
      the rest are released after the backward.
    * ``--no-overlap``: no launch during backward, no prefetch ahead."""
    if par.zero < 2 or max(group_sizes(par).values()) <= 1:
        return (0, 0, (0,), 0, (), (0,), (0,), (0,), (), (), ())
    if par.pp > 1 and len(rank_stages(par, pp_rank)) > 1:
        return None
    bks = buckets(m, par, pp_rank)
    gb, pb = grad_bytes(par), param_bytes(par)
    runs = arrival_runs(m, _state_key(par), pp_rank)
    nparams = [0] * len(bks)  # gradients per bucket
    for i, k in runs:
        nparams[i] += k
    seqs: dict[str, list[int]] = {}
    for i, b in enumerate(bks):
        seqs.setdefault(b.group, []).append(i)
    # ZeRO-3 gather units: blocks (pp = 1) or the one chunk, and the root (-1)
    ubytes: dict[int, int] = {}
    bbytes: dict[int, int] = {}  # a backward gather's (rowwise fp8 under full recompute: 2 casts)
    for b in bks:
        eb = b.padded * (b.gathered_bytes_per_element or pb)
        ubytes[b.unit] = ubytes.get(b.unit, 0) + eb
        again = par.recompute == "full" and b.gathered_bytes_per_element  # (``_zero_key``)
        bbytes[b.unit] = bbytes.get(b.unit, 0) + eb * (2 if again else 1)
    held: dict[int, int] = {}  # gathered unit -> its bytes
    sbytes: dict[int, int] = {}  # the fp8 gather's scales, from a unit's first gather to the end
    for b in bks:
        if b.gathered_bytes_per_element:
            sbytes[b.unit] = sbytes.get(b.unit, 0) + 4 * b.fp8_amax
    scaled: set[int] = set()
    nblocks = sorted(u for u in ubytes if u >= 0) if par.pp == 1 else []
    uparams: dict[int, int] = {}
    for i, b in enumerate(bks):
        uparams[b.unit] = uparams.get(b.unit, 0) + nparams[i]
    grads: set[int] = set()  # buckets whose full gradient buffer is held
    gathered: set[int] = set()  # gathered units
    live = [0, 0]  # bytes held: gradients, parameters
    peak = [0, 0]
    starts: list[int] = []  # held at each replayed micro-batch's first gradient
    fends: list[int] = []  # held at the end of each replayed forward (ZeRO-3 without pp)
    pres: list[int] = []  # held as each replayed backward begins
    mlps: list[int] = []  # held once the first block's MLP gradients are in
    heads: list[int] = []  # held at the first gradient (ZeRO-3: the root's, no block's yet)
    flasts: list[int] = []  # held while the last block runs its forward (ZeRO-3 without pp)
    fprevs: list[int] = []  # held while the block before it runs its forward
    mlp_ends = mlp_grad_ends(m, _state_key(par), pp_rank)
    blocks: list[tuple[int, ...]] = []  # held at each block's MLP end, per micro-batch

    def hold(kind: int, n: int) -> None:
        live[kind] += n
        if sum(live) > sum(peak):
            peak[:] = live

    def gather(u: int | None, back: bool = False) -> None:
        if u is not None and u in ubytes and u not in gathered:
            gathered.add(u)
            held[u] = (bbytes if back else ubytes)[u]
            if u not in scaled:
                scaled.add(u)
                hold(1, sbytes.get(u, 0))
            hold(1, held[u])

    def free(u: int) -> None:
        if u in gathered:
            gathered.discard(u)
            live[1] -= held.pop(u)

    def drop(i: int) -> None:
        if i in grads:
            grads.discard(i)
            live[0] -= bks[i].padded * gb

    def prefetch(u: int | None, back: bool = False) -> None:
        if par.overlap:
            gather(u, back)

    def nxt(u: int, step: int) -> int | None:
        k = nblocks.index(u) + step
        return nblocks[k] if 0 <= k < len(nblocks) else None

    zero3_flat = par.zero == 3 and par.pp == 1
    # every micro-batch between the first and the last starts from the same state (all
    # gradient buffers held, nothing gathered) and so replays the second's: one stands for all
    for micro in sorted({0, 1, par.micro_batches - 1} & set(range(par.micro_batches))):
        last = micro == par.micro_batches - 1
        if par.zero == 3 and par.pp > 1:
            gather(next(iter(ubytes)))  # the chunk, whole through its F and B
        if zero3_flat:  # forward
            gather(-1)
            prefetch(nblocks[0] if nblocks else None)
            for u in nblocks:
                gather(u)
                prefetch(nxt(u, 1))
                if u == nblocks[-1]:
                    flasts.append(sum(live))
                elif len(nblocks) > 1 and u == nblocks[-2]:  # the last one prefetched
                    fprevs.append(sum(live))
                free(u)
            fends.append(sum(live))  # the loss: the root gathered, the blocks freed
            # backward: the root stays gathered from its forward
            prefetch(nblocks[-1] if nblocks else None, back=True)
        done = [0] * len(bks)
        udone: dict[int, int] = {}
        launched = {g: 0 for g in seqs}
        block = None
        first = True
        pres.append(sum(live))  # the backward begins: nothing of it arrived yet
        arrived = 0
        ends: list[int] = []
        for i, k in runs:  # k gradients in a row into bucket i
            u = bks[i].unit
            if zero3_flat and u >= 0 and u != block:  # the block's pre-backward hook
                block = u
                gather(u, back=True)
                prefetch(nxt(u, -1), back=True)
            if i not in grads:
                grads.add(i)
                hold(0, bks[i].padded * gb)
            if len(heads) < len(pres):
                heads.append(sum(live))
            if first and (not zero3_flat or u >= 0):  # the first block's gradient (ZeRO-3:
                starts.append(sum(live))  # its unit and the next gathered, the root's held)
                first = False
            while len(ends) < len(mlp_ends) and mlp_ends[len(ends)] <= arrived + k:
                ends.append(sum(live))  # (the allocations only: a unit's free and a
            arrived += k  # launch's drop come at the block's end)
            if zero3_flat:
                udone[u] = udone.get(u, 0) + k
                if udone[u] == uparams[u]:
                    free(u)
            done[i] += k
            if not (last and par.overlap) or done[i] < nparams[i]:
                continue
            seq = seqs[bks[i].group]
            while launched[bks[i].group] < len(seq) and done[seq[launched[bks[i].group]]] == \
                    nparams[seq[launched[bks[i].group]]]:
                launched[bks[i].group] += 1
                k = launched[bks[i].group]
                if k > 2:
                    drop(seq[k - 3])
        blocks.append(tuple(ends))
        mlps.append(ends[0] if ends else (starts[-1] if starts else sum(live)))
    return (peak[0], peak[1], tuple(starts), sum(live), tuple(fends), tuple(pres),
            tuple(mlps), tuple(heads), tuple(flasts), tuple(fprevs), tuple(blocks))


def _zero_buffers_estimate(m: ModelConfig, par: ParallelConfig, pp_rank: int
                           ) -> dict[str, float]:
    """ZeRO-2/3 with several pipeline chunks per rank (not replayed): every bucket's buffer
    with m > 1 (else the three largest) and, ZeRO-3, every chunk gathered (per step) or one."""
    bks = buckets(m, par, pp_rank)
    gb = grad_bytes(par)
    sizes = [b.padded for b in bks]
    out = {"zero_full_grads": float((sum(sizes) if par.micro_batches > 1 else
                                     sum(sorted(sizes, reverse=True)[:3])) * gb)}
    if par.zero == 3:
        units: dict[int, int] = {}
        for b in bks:
            units[b.unit] = units.get(b.unit, 0) + b.padded * (
                b.gathered_bytes_per_element or param_bytes(par))
        whole = len(units) if par.zero3_pp_gather == "step" else 1
        scales = sum(4 * b.fp8_amax for b in bks if b.gathered_bytes_per_element)
        out["zero3_gather"] = float(sum(sorted(units.values(), reverse=True)[:whole]) + scales)
    return out


def comm_buffers(m: ModelConfig, par: ParallelConfig, micro_batch: int, pp_rank: int = 0
                 ) -> dict[str, float]:
    """Transient buffers, by dimension (the engine reports the ZeRO ones as ``buffers``).

    ZeRO-2/3 (``zero_full_grads``, ``zero3_gather``): the full-gradient bytes and the gathered
    parameter bytes at the step's peak of the two together, from ``zero_buffer_peak``'s
    replay of the engine's lifecycle, not a formula: a bucket's full gradient buffer lives
    from its first gradient to its reduce-scatter's wait; the two reduction groups (dense,
    expert) each launch in their own order and keep at most two in flight (the third launch
    waits for the first); the reduce-scatters run on the last micro-batch, so with m > 1
    every buffer lives through the accumulation. ZeRO-3 without pp adds the unit in use, the
    prefetched next one and the root (embedding, norm, head: gathered at the start of forward
    and of backward, its gradient bucket, holding the head's gradient first and the
    embedding's last, alive through the whole backward); with pp the rank's chunk is whole
    whenever a gradient arrives. The dry run (``fived.ledger.verify.compare_dry_extras``)
    finds the replay exact to the byte on every distinct rank: tiny, tiny-moe and small;
    dp2, dp2·ep2, dp4·ep2, pp2·dp2, pp2·dp2·ep2; zero 2 and 3; m = 1, 2; --no-overlap;
    --recompute full; --zero3-pp-gather step and micro. With several pipeline chunks per rank
    (interleaved, zb-v, dualpipe-v) it is estimated: every gradient buffer with m > 1 (else
    the three largest) and every chunk gathered (per step) or the largest (per micro-batch);
    exact in the dry run except ZeRO-3 per micro-batch, where it bounds from above
    (``verify.buffers_check_skipped``). Grouped expert matmuls add one MoE layer's stacked
    expert weights (``expert_stack``, ``expert_stack_bytes``)."""
    return dict(_comm_buffers(m, par, micro_batch, pp_rank))


@lru_cache(maxsize=8192)
def _comm_buffers(m: ModelConfig, par: ParallelConfig, micro_batch: int, pp_rank: int
                  ) -> tuple[tuple[str, float], ...]:
    e = act_bytes(par)
    tokens = micro_batch * m.seq_len / par.cp
    sp = par.sequence_parallel and par.tp > 1
    out: dict[str, float] = {}
    if par.zero >= 2 and max(group_sizes(par).values()) > 1:
        sim = zero_buffer_peak(m, par, pp_rank)
        if sim is not None:
            out["zero_full_grads"] = float(sim[0])
            if par.zero == 3:
                out["zero3_gather"] = float(sim[1])
        else:
            out.update(_zero_buffers_estimate(m, par, pp_rank))
    if par.pp > 1:
        out["pp_p2p"] = 2 * tokens * m.hidden * e / (par.tp if sp else 1)
    if sp:
        out["sp_gather"] = tokens * m.hidden * e
    if par.cp > 1:
        kv_heads = m.heads if m.is_mla else m.kv_heads
        kv = tokens * 2 * max(1, kv_heads // par.tp) * m.qk_head_dim * e
        out["cp_ring"] = 2 * kv * 2  # K/V in flight + dK/dV in flight, double-buffered
    if par.ep > 1 and m.is_moe:
        out["ep_a2a"] = 2 * tokens * m.top_k * m.hidden * e
    if grouped_experts(m, par) and any(
            m.is_moe_layer(i) for st in rank_stages(par, pp_rank)
            for i in stage_layers(m, par)[st]):
        out["expert_stack"] = expert_stack_bytes(m, par)
    return tuple(out.items())


def grouped_experts(m: ModelConfig, par: ParallelConfig) -> bool:
    """Whether the experts run as grouped matmuls (``fived.model.grouped``) in the run the
    ledger describes — a GPU's, or the dry run's fake tensors: ``grouped``, or ``auto`` in
    bf16 with rows of a multiple of 16 bytes (``grouped.grouped_supported``; CUDA's kernel and
    the op's meta function take bf16 only). A real CPU run groups fp32 rows too; there the
    ledger counts the loop's smaller working set."""
    if not m.is_moe or m.expert_matmul == "loop":
        return False
    if m.expert_matmul == "grouped":
        return True
    e = act_bytes(par)
    return (precision_of(par) == "bf16" and (m.hidden * e) % 16 == 0
            and (m.expert_ffn * e) % 16 == 0)


def expert_stack_bytes(m: ModelConfig, par: ParallelConfig) -> float:
    """Grouped expert matmuls (``fived.model.grouped``, ``expert_matmul`` grouped or auto): the
    transient stack of one MoE layer's local expert weights, made in its forward and again in
    its backward, never saved — (E/ep) · 3 · h · f_e elements in the compute dtype. Counted
    for ``auto`` too (grouped wherever ``torch._grouped_mm`` runs; the ledger knows no device)."""
    return float(m.experts // par.ep * 3 * m.hidden * m.expert_ffn * act_bytes(par))


# ------------------------------------------------------------------------ the whole rank
@dataclass
class RankMemory:
    pp_rank: int
    states: dict[str, int]
    activations: dict[str, float]
    buffers: dict[str, float]
    inflight: float
    terms: dict[str, float] = field(default_factory=dict)
    peak: float = 0.0  # the step's peak (``fived.ledger.peak``; 0: not computed)
    peak_phase: str = ""
    peak_transients: dict[str, float] = field(default_factory=dict)

    @property
    def kept(self) -> float:
        """Model states and the saved activations at their worst moment."""
        return self.states_total + self.activations_total

    @property
    def states_total(self) -> int:
        return sum(self.states.values())

    @property
    def activations_total(self) -> float:
        return sum(self.activations.values())

    @property
    def buffers_total(self) -> float:
        return sum(self.buffers.values())

    @property
    def total(self) -> float:
        return self.states_total + self.activations_total + self.buffers_total

    def as_dict(self) -> dict:
        return {"pp_rank": self.pp_rank, "states": self.states, "activations": self.activations,
                "buffers": self.buffers, "inflight_microbatches": self.inflight,
                "states_total": self.states_total, "activations_total": self.activations_total,
                "buffers_total": self.buffers_total, "total": self.total, "kept": self.kept,
                "peak": self.peak, "peak_phase": self.peak_phase,
                "peak_transients": self.peak_transients}


def rank_memory(m: ModelConfig, par: ParallelConfig, micro_batch: int, pp_rank: int = 0,
                opts: ActivationOptions = EAGER, optimizer: str = "adamw") -> RankMemory:
    return RankMemory(pp_rank, model_states(m, par, pp_rank, optimizer=optimizer),
                      activations(m, par, micro_batch, pp_rank, opts),
                      comm_buffers(m, par, micro_batch, pp_rank),
                      inflight_microbatches(par, pp_rank))


def candidate_ranks(par: ParallelConfig) -> list[int]:
    """The pipeline ranks ``largest_rank`` compares: all of them up to pp 8, else the first
    two and the last (the first holds the most micro-batches, the last the head)."""
    if par.pp <= 8:
        return list(range(par.pp))
    return sorted({0, 1, par.pp - 1})


def largest_rank(m: ModelConfig, par: ParallelConfig, micro_batch: int,
                 opts: ActivationOptions = EAGER, optimizer: str = "adamw") -> RankMemory:
    """The pipeline rank with the most bytes (ties: the lowest rank)."""
    return max((rank_memory(m, par, micro_batch, r, opts, optimizer)
                for r in candidate_ranks(par)), key=lambda r: r.total)


def states_floor(m: ModelConfig, par: ParallelConfig, optimizer: str = "adamw") -> float:
    """A lower bound on ``largest_rank(...).total``: the most model-state bytes of the ranks
    it compares (activations and buffers are never negative). Cheap: the states are cached
    per state layout, so the planner drops a layout that cannot fit before its activations,
    buffer replay, traffic and clock are worked out."""
    return max(sum(model_states(m, par, r, optimizer=optimizer).values())
               for r in candidate_ranks(par))


def fmt_bytes(n: float) -> str:
    """Bytes in binary units, the one system of every command (docs/cli.md): B, KiB, MiB, GiB,
    TiB (powers of 1024), two decimals."""
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024:
            return f"{v:.0f} B" if unit == "B" else f"{v:.2f} {unit}"
        v /= 1024
    return f"{v:.2f} TiB"


