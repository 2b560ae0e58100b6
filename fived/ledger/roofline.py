"""The roofline clock: every operation of a block timed at its real shape on one rank.

One micro-batch of ``b`` sequences on one rank holds T = b·s/cp tokens (s = seq_len); with
sequence parallelism the norms and residuals see T/tp of them. Each operation is

    gemm   (M×K)·(K×N): t = max(2MNK / (peak · eff(M, N, K)), e·(MK + KN + MN) / bw)
           eff(M, N, K) = gemm_eff · Π_{d∈M,N,K} d / (d + gemm_d0)
           backward: dX = dY·Wᵀ (M×N)·(N×K) and dW = Xᵀ·dY (K×M)·(M×N), each at its own shape
    attn   flash: 4·b·(s/cp)·s·(heads/tp)·d FLOPs forward, halved (causal), at attn_eff·peak;
           backward 2.5× forward (it recomputes the scores: 5 matmuls against 2). The runtime's
           eager attention ("materialised") is two batched GEMMs (QKᵀ, PV; masked, not halved)
           plus the softmax over the (s/cp)×s scores at memory bandwidth
    mem    bytes / (hbm_bw · mem_eff): norms (read, write), residual adds (read 2, write 1),
           RoPE on q and k, SiLU·mul (read 2, write 1) or GELU (read, write), the embedding
           gather, the cross-entropy over the logits; backward moves twice the forward's bytes

``ClockOptions`` states how the predicted runtime runs its kernels: ``fused_gemm`` (Megatron's
linear_qkv and linear_fc1: q, k, v as one GEMM and SwiGLU's gate and up as one), ``fused_loss``
(False: the unfused fp32 cross-entropy, ``LOSS_EAGER`` bytes per logit), ``fused`` (False:
eager element-wise kernels, ``EAGER``), the attention kernel and what communication overlaps.

plus ``overhead`` seconds per operation (kernel launch on a GPU). On this machine (``--gpu
this-machine``) the eager runtime's own cost is measured instead, per block and per stage
(``block_overhead``, ``stage_overhead``: a tiny model's forward and backward).
e is the compute dtype's bytes; peak the dense bf16 (or fp32) matmul FLOP/s; bw the HBM
bandwidth. The cuts follow the runtime: q/o and the MLP are cut tp ways, k/v
min(tp, kv_heads) ways; routed experts are whole on every tp rank and see T·top_k·ep/E tokens
each (balanced routing), T/tp with SP; the head is cut tp ways. MLA (``_mla_gemms``): the
down-projections whole over the rank's tokens (T/tp with SP), the up-projections and o_proj
over H/tp heads; its flash core 2·b·(s/cp)·s·(H/tp)·(d_q + d_v) FLOPs forward, halved (v at its
own width, as a GPU kernel takes it; the CPU runtime pads it).

Per micro-batch on a pipeline rank (its layers, + the embedding on the first stage, + final
norm, head and loss on the last): ``fwd``, ``bwd``, ``recompute`` (full: the blocks' forward
again; selective: the attention core's forward again), and the parts the planner overlaps
communication with (``gemm``: matmul seconds, ``attn_core``: the core's forward seconds).
The optimizer step is memory-bound: its bytes are read and written once (2 × the model states).
Communication is ``hardware.collective_seconds`` (α-β), composed by ``planner.predict``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from ..config import ModelConfig, ParallelConfig, precision_of
from . import mla
from .hardware import Hardware


@dataclass(frozen=True)
class Op:
    name: str
    kind: str  # gemm | attn | mem
    flops: float
    bytes: float
    dims: tuple[float, float, float] = (0.0, 0.0, 0.0)  # M, N, K of a GEMM
    count: float = 1.0  # identical launches (experts, per-head batched GEMMs count once)
    fp8: bool = False  # an fp8 linear's GEMM (--fp8): the device's fp8 peak


@dataclass(frozen=True)
class ClockOptions:
    """How the runtime being predicted runs its kernels (facts of a run, not tuned knobs)."""

    attention: str = "flash"  # flash | materialised (the fived runtime's eager attention)
    tp_overlap: bool = False  # TP collectives hidden behind the GEMMs (Megatron --tp-comm-overlap)
    fused: bool = True  # element-wise work in fused kernels (GPU stacks); False: eager PyTorch
    comm_overlap: bool = True  # False: communication shares the compute's cores (a CPU), exposed
    # Megatron's linear_qkv and linear_fc1: q, k, v as one GEMM (N = q + 2·kv columns) and
    # SwiGLU's gate and up as one (N = 2·ffn/tp); False: separate GEMMs (fived, torchtitan)
    fused_gemm: bool = False
    # the cross-entropy as one fused kernel (read the logits, write fp32 log-probabilities);
    # False: Megatron's unfused vocab-parallel cross-entropy (its --cross-entropy-loss-fusion
    # is opt-in) or eager PyTorch: see ``LOSS_EAGER``
    fused_loss: bool = True
    # --doc-mask: the keys a token attends to on average, Σ Lᵢ²/S (``compute.doc_context``);
    # 0: the whole window (S). The flash kernel's FLOPs follow it (a per-document kernel skips
    # the other documents' blocks); materialised scores stay S wide (a mask computes them all)
    attn_context: float = 0.0


# Eager PyTorch (the fived runtime on a CPU) runs each element-wise step as its own kernel:
# (kernels, bytes as a multiple of the fused kernel's) per forward op, e.g. RMSNorm = pow,
# mean, rsqrt·mul, ·gain; RoPE = two muls, the half rotation (slice, neg, cat) and an add.
EAGER = {"norms": (4, 3.0), "rope": (6, 3.0), "mlp.act": (2, 5 / 3), "residual": (1, 1.0)}


# The unfused cross-entropy's bytes per logit (e: the logits' dtype bytes), pass by pass
# (Megatron-Core tensor_parallel/cross_entropy.py): forward = cast to fp32 (e + 4), max (4),
# subtract in place (8), exp in place (8), sum (4), divide in place (8); backward = scale by
# the loss gradient in place (8), cast back (4 + e). (kernels, bytes(e)) forward and backward.
LOSS_EAGER = {"fwd": (6, lambda e: e + 36), "bwd": (2, lambda e: e + 12)}


# the GEMMs of the linear layers ``--fp8`` runs in fp8 (``fived.parallel.fp8``), by name
FP8_GEMMS = ("q", "k", "v", "qkv", "o", "mlp", "expert", "shared")


def dtype_bytes(par: ParallelConfig) -> int:
    return 4 if precision_of(par) == "fp32" else 2


def gemm_efficiency(hw: Hardware, m: float, n: float, k: float) -> float:
    eff = hw.gemm_eff
    for d in (m, n, k):
        eff *= d / (d + hw.gemm_d0)
    return eff


def _table_seconds(op: Op, hw: Hardware) -> float | None:
    """A GEMM's time from ``hw.gemm_table`` (this-machine), scaled by FLOPs from the nearest
    measured shape (log distance); None when there is no table."""
    if not hw.gemm_table:
        return None
    import math

    m, n, k = _table_dims(op)

    def dist(row):
        return sum(abs(math.log(max(a, 1.0) / max(b, 1.0))) for a, b in zip(row[:3], (m, n, k)))

    row = min(hw.gemm_table, key=dist)
    return row[3] * (m * n * k) / (row[0] * row[1] * row[2])


def _table_dims(op: Op) -> tuple[float, float, float]:
    """A batched GEMM (count > 1: per-head scores, experts) runs as one call: timed as one
    GEMM of the same FLOPs, (count·M) × K by K × N."""
    m, n, k = op.dims
    return (m * op.count, n, k)


def op_seconds(op: Op, hw: Hardware, precision: str) -> float:
    if op.kind == "gemm":
        measured = _table_seconds(op, hw)
        if measured is not None:
            return measured
    peak = hw.matmul_peak("fp8" if op.fp8 else precision)
    bw = hw.hbm_bw * hw.mem_eff
    t_mem = op.bytes / bw
    if op.kind == "gemm":
        t = max(op.flops / (peak * gemm_efficiency(hw, *op.dims)), t_mem)
    elif op.kind == "attn":
        t = max(op.flops / (peak * hw.attn_eff), t_mem)
    else:
        t = t_mem
    return t + hw.overhead * op.count


def _gemm(name: str, m: float, n: float, k: float, e: int, count: float = 1.0) -> Op:
    return Op(name, "gemm", 2.0 * m * n * k * count, e * (m * k + k * n + m * n) * count,
              (m, n, k), count)


def _gemm_bwd(op: Op, e: int) -> list[Op]:
    m, n, k = op.dims
    return [_gemm(op.name + ".dx", m, k, n, e, op.count), _gemm(op.name + ".dw", k, n, m, e,
                                                                op.count)]


def _mem(name: str, nbytes: float, count: float = 1.0) -> Op:
    return Op(name, "mem", 0.0, nbytes, count=count)


def block_ops(m: ModelConfig, par: ParallelConfig, b: int, opts: ClockOptions
              ) -> dict[str, list[Op]]:
    """One block, one micro-batch, one rank: {"fwd", "bwd", "core_fwd"} operation lists."""
    e = dtype_bytes(par)
    tp, cp = par.tp, par.cp
    s = m.seq_len
    t = b * s / cp
    t_sp = t / tp if (par.sequence_parallel and tp > 1) else t
    h, d = m.hidden, m.head_dim
    hq = m.heads * d / tp
    hkv = m.kv_heads * d / min(tp, m.kv_heads)
    latent_ring = m.is_mla and cp > 1 and par.cp_mode == "ring-latent"
    if m.is_mla:  # the latents (whole on every tp rank, the sequence shard under SP), the
        # per-head up-projections and o_proj (heads cut); RoPE on the rotary widths only
        gemms = _mla_gemms(m, tp, t, t_sp, e, mla.kv_b_products(cp, latent_ring)[0])
        hq, hkv = m.heads * m.qk_rope_head_dim / tp, m.qk_rope_head_dim
    elif opts.fused_gemm:
        gemms = [_gemm("qkv", t, hq + 2 * hkv, h, e), _gemm("o", t, h, hq, e)]
    else:
        gemms = [_gemm("q", t, hq, h, e), _gemm("k", t, hkv, h, e), _gemm("v", t, hkv, h, e),
                 _gemm("o", t, h, hq, e)]
    act = 0.0
    if m.is_moe:
        f = m.expert_ffn
        te = t_sp  # experts are whole on every tp rank: all T tokens without SP, T/tp with it
        local = m.experts // par.ep
        per = te * m.top_k * par.ep / m.experts
        gemms.append(_gemm("router", te, m.experts, h, e))
        gemms += [_gemm("expert.gate", per, f, h, e, local), _gemm("expert.up", per, f, h, e,
                                                                     local),
                  _gemm("expert.down", per, h, f, e, local)]
        act += 3 * e * te * m.top_k * f
        if m.shared_expert:
            fs = m.shared_ffn / tp
            gemms += [_gemm("shared.gate", t, fs, h, e), _gemm("shared.up", t, fs, h, e),
                      _gemm("shared.down", t, h, fs, e)]
            act += 3 * e * t * fs
    else:
        f = m.ffn / tp
        if m.mlp == "swiglu" and opts.fused_gemm:
            gemms.append(_gemm("mlp.gate_up", t, 2 * f, h, e))
            act += 3 * e * t * f
        elif m.mlp == "swiglu":
            gemms += [_gemm("mlp.gate", t, f, h, e), _gemm("mlp.up", t, f, h, e)]
            act += 3 * e * t * f
        else:
            gemms.append(_gemm("mlp.up", t, f, h, e))
            act += 2 * e * t * f
        gemms.append(_gemm("mlp.down", t, h, f, e))
    core = _attention_ops(m, par, b, opts, e)
    mems = [_mem("norms", 2 * 2 * e * t_sp * h, 2), _mem("residual", 2 * 3 * e * t_sp * h, 2),
            _mem("mlp.act", act)]
    if m.positions == "rope":
        mems.append(_mem("rope", 2 * e * t * (hq + hkv), 2))
    if not opts.fused:
        mems = [Op(o.name, "mem", 0.0, o.bytes * EAGER[o.name][1],
                   count=o.count * EAGER[o.name][0]) for o in mems]
    if getattr(par, "fp8", "none") != "none":  # the linears' three products (not the router)
        gemms = [replace(g, fp8=True) if g.name.split(".")[0] in FP8_GEMMS
                 and g.name != "router" else g for g in gemms]
    core_fwd = core["fwd"]
    if latent_ring:  # the ring's backward up-projects every block again; selective recompute
        # reruns the ring's forward, its up-projections with it
        kv_b = next(op for op in gemms if op.name == "kv_b")
        core = {"fwd": core["fwd"], "bwd": core["bwd"] + [replace(kv_b, name="kv_b.again")]}
        core_fwd = core_fwd + [kv_b]
    fwd = gemms + core["fwd"] + mems
    bwd = [replace(g, fp8=op.fp8) for op in gemms for g in _gemm_bwd(op, e)] + core["bwd"]
    bwd += [_mem(op.name + ".bwd", 2 * op.bytes, 2 * op.count) for op in mems]
    return {"fwd": fwd, "bwd": bwd, "core_fwd": core_fwd}


def _mla_gemms(m: ModelConfig, tp: int, t: float, t_sp: float, e: int, blocks: int = 1
               ) -> list[Op]:
    """MLA's matmuls on one tp rank (``fived.ledger.mla``): the down-projections over the
    rank's tokens (t_sp: the sequence shard under SP), the up-projections and o_proj over its
    heads; W_kvb's ``blocks`` times (the latent ring: every block the rank holds,
    ``mla.kv_b_products``)."""
    h, H = m.hidden, m.heads / tp
    rq, rkv, dr = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    out = ([_gemm("q_a", t_sp, rq, h, e), _gemm("q_b", t, H * m.qk_head_dim, rq, e)] if rq
           else [_gemm("q", t, H * m.qk_head_dim, h, e)])
    return out + [_gemm("kv_a", t_sp, rkv + dr, h, e),
                  _gemm("kv_b", t, H * (m.qk_nope_head_dim + m.v_head_dim), rkv, e, blocks),
                  _gemm("o", t, h, H * m.v_head_dim, e)]


def _attention_ops(m: ModelConfig, par: ParallelConfig, b: int, opts: ClockOptions, e: int
                   ) -> dict[str, list[Op]]:
    tp, cp = par.tp, par.cp
    s, d = m.seq_len, m.qk_head_dim
    q_len = s / cp
    heads = m.heads / tp
    hq = heads * d
    hkv = heads * d if m.is_mla else m.kv_heads * d / min(tp, m.kv_heads)
    t = b * q_len
    if opts.attention == "flash":
        ctx = min(opts.attn_context or s, s)  # --doc-mask: Σ Lᵢ²/S instead of S
        # causal: half the score blocks are skipped; MLA: q·kᵀ over d_q, p·v over d_v
        flops = (2.0 * t * ctx * heads * (m.qk_head_dim + m.v_head_dim) / 2 if m.is_mla
                 else 4.0 * t * ctx * hq / 2)
        io = (e * t * heads * (2 * m.qk_head_dim + 2 * m.v_head_dim) if m.is_mla
              else e * t * (2 * hq + 2 * hkv))
        fwd = Op("attn.flash", "attn", flops, io)
        return {"fwd": [fwd], "bwd": [Op("attn.flash.bwd", "attn", 2.5 * flops, 2 * io)]}
    n = b * heads  # one batched GEMM over (batch, head)
    scores = _gemm("attn.qk", q_len, s, d, e, n)
    pv = _gemm("attn.pv", q_len, d, s, e, n)
    soft = _mem("attn.softmax", 4 * e * t * s * heads)  # mask add, softmax read and write
    kv = _mem("attn.kv_repeat", 2 * e * t * hq) if m.kv_heads < m.heads else None
    fwd = [scores, pv, soft] + ([kv] if kv else [])
    bwd = _gemm_bwd(scores, e) + _gemm_bwd(pv, e) + [_mem("attn.softmax.bwd", 3 * e * t * s *
                                                          heads)]
    return {"fwd": fwd, "bwd": bwd}


def stage_extra_ops(m: ModelConfig, par: ParallelConfig, b: int, first: bool, last: bool,
                    opts: ClockOptions | None = None) -> dict[str, list[Op]]:
    """The embedding (first stage) and the final norm, head and loss (last stage)."""
    e = dtype_bytes(par)
    t = b * m.seq_len / par.cp
    fwd: list[Op] = []
    bwd: list[Op] = []
    if first:
        fwd.append(_mem("embed", 2 * e * t * m.hidden))
        bwd.append(_mem("embed.bwd", 3 * e * t * m.hidden))
    if last:
        v = m.vocab / par.tp
        head = _gemm("head", t, v, m.hidden, e)
        fused = opts is None or (opts.fused_loss and opts.fused)
        # fused: read the logits, write fp32 log-probabilities (and back)
        lf = _mem("loss", t * v * (e + 4)) if fused else _mem(
            "loss", t * v * LOSS_EAGER["fwd"][1](e), LOSS_EAGER["fwd"][0])
        lb = _mem("loss.bwd", t * v * (4 + e)) if fused else _mem(
            "loss.bwd", t * v * LOSS_EAGER["bwd"][1](e), LOSS_EAGER["bwd"][0])
        fwd += [_mem("final_norm", 2 * e * t * m.hidden), head, lf]
        bwd += [_mem("final_norm.bwd", 4 * e * t * m.hidden), *_gemm_bwd(head, e), lb]
    return {"fwd": fwd, "bwd": bwd}


def gemm_shapes(m: ModelConfig, par: ParallelConfig, b: int, opts: ClockOptions | None = None
                ) -> list[tuple[int, int, int]]:
    """Every distinct GEMM shape (M, N, K) one micro-batch runs on any pipeline rank."""
    ops = block_ops(m, par, b, opts or ClockOptions())
    ext = stage_extra_ops(m, par, b, True, True)
    out = {tuple(int(round(d)) for d in _table_dims(o)) for o in ops["fwd"] + ops["bwd"]
           + ext["fwd"] + ext["bwd"] if o.kind == "gemm"}
    return sorted(out)


def _seconds(ops: list[Op], hw: Hardware, precision: str, kind: str | None = None) -> float:
    return sum(op_seconds(o, hw, precision) for o in ops if kind is None or o.kind == kind)


def micro_batch_times(m: ModelConfig, par: ParallelConfig, b: int, hw: Hardware, layers: int,
                      first: bool, last: bool, opts: ClockOptions | None = None
                      ) -> dict[str, float]:
    """Seconds of one micro-batch on a pipeline rank with ``layers`` blocks: fwd, bwd,
    recompute, and the parts communication can hide behind (gemm, attn_core), memory-bound."""
    return dict(_micro_batch_times(m, par, b, hw, layers, first, last, opts or ClockOptions()))


@lru_cache(maxsize=65536)
def _micro_batch_times(m: ModelConfig, par: ParallelConfig, b: int, hw: Hardware, layers: int,
                       first: bool, last: bool, opts: ClockOptions) -> dict[str, float]:
    p = precision_of(par)
    blk = block_ops(m, par, b, opts)
    ext = stage_extra_ops(m, par, b, first, last, opts)
    if hw.eager:
        return _eager_times(blk, ext, hw, p, par, layers, first, last)
    f_blk = _seconds(blk["fwd"], hw, p)
    b_blk = _seconds(blk["bwd"], hw, p)
    core = _seconds(blk["core_fwd"], hw, p)
    # the eager runtime's own cost (this-machine): a third in the forward, two in the backward
    over = layers * hw.block_overhead + (hw.stage_overhead if first or last else 0.0)
    out = {
        "fwd": layers * f_blk + _seconds(ext["fwd"], hw, p) + over / 3,
        "bwd": layers * b_blk + _seconds(ext["bwd"], hw, p) + 2 * over / 3,
        "attn_core": layers * core,
        "gemm": layers * (_seconds(blk["fwd"], hw, p, "gemm") + _seconds(blk["bwd"], hw, p,
                                                                          "gemm")),
        "memory_bound": layers * (_seconds(blk["fwd"], hw, p, "mem")
                                  + _seconds(blk["bwd"], hw, p, "mem")),
    }
    return _with_recompute(out, par, layers, f_blk)


def _eager_times(blk: dict, ext: dict, hw: Hardware, p: str, par: ParallelConfig, layers: int,
                 first: bool, last: bool) -> dict[str, float]:
    """this-machine with ``hw.eager``: the GEMMs from the table (the attention's materialised
    GEMMs excluded: the runtime's attention is one measured kernel), everything else as
    measured (``fived.probe.kernels``), plus the runtime's dispatch per block and stage."""
    a_f, a_b, e_f, e_b, first_f, first_b, last_f, last_b = hw.eager

    def gemms(ops):
        return sum(op_seconds(o, hw, p) for o in ops
                   if o.kind == "gemm" and not o.name.startswith("attn."))

    g_f, g_b = gemms(blk["fwd"]), gemms(blk["bwd"])
    over = layers * hw.block_overhead + (hw.stage_overhead if first or last else 0.0)
    x_f = (first_f if first else 0.0) + (last_f if last else 0.0) + gemms(ext["fwd"])
    x_b = (first_b if first else 0.0) + (last_b if last else 0.0) + gemms(ext["bwd"])
    f_blk = g_f + a_f + e_f
    out = {
        "fwd": layers * f_blk + x_f + over / 3,
        "bwd": layers * (g_b + a_b + e_b) + x_b + 2 * over / 3,
        "attn_core": layers * a_f,
        "gemm": layers * (g_f + g_b),
        "memory_bound": layers * (e_f + e_b),
    }
    return _with_recompute(out, par, layers, f_blk)


def _with_recompute(out: dict[str, float], par: ParallelConfig, layers: int, f_blk: float
                    ) -> dict[str, float]:
    if par.recompute == "full":
        out["recompute"] = layers * f_blk
    elif par.recompute == "selective":
        out["recompute"] = out["attn_core"]
    else:
        out["recompute"] = 0.0
    return out


def optimizer_seconds(state_bytes: float, hw: Hardware) -> float:
    """The optimizer step reads and writes the rank's model states once."""
    return 2.0 * state_bytes / (hw.hbm_bw * hw.mem_eff)
