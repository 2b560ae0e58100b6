"""Step time, tokens/s and MFU of a layout, and the search over layouts (``fived plan``).

Time model of one optimizer step on the slowest pipeline rank (every term is reported):

    t_f, t_b, t_rc   the rank's forward, backward and recompute (full: the blocks' forward
             again; selective: the attention core's) of one micro-batch: the roofline clock
             (``roofline.micro_batch_times``: every op at its shape), or with ``efficiency``
             the old flat clock (forward FLOPs / (peak · efficiency), backward 2×)
    per micro-batch, exposed (not overlapped) communication:
      tp     every TP/SP collective (it sits between two matmuls that need its result);
             with ``ClockOptions.tp_overlap`` max(0, tp − the GEMM time)
      ep     every all-to-all (dispatch and combine block the experts)
      cp     max(0, ring time − attention-core time): the next K/V block moves while this one
             is used
      pp     the sends of the rank's stage boundaries (on the critical path of the schedule)
      zero3  max(0, gather − t_f) forward and max(0, gather + reduce-scatter − t_b) backward
             (prefetch overlaps the parameter gathers with compute)
      zero2  max(0, reduce-scatter − t_b) per micro-batch
    T_mb   = t_f + t_b + t_rc + exposed per micro-batch
    T_pipe = (m + bubble_ticks)·T_mb          (``bubble.bubble_ticks``: p−1, (p−1)/v, (p−1)/3)
    dp     gradient all-reduce / reduce-scatter overlaps the last micro-batch's backward, the
           ZeRO-1/2 parameter all-gather the first micro-batch's forward (``--no-overlap``:
           fully exposed); exposed = max(0, comm − window)
    opt    optimizer step: 2 · model-state bytes / HBM bandwidth (read and write once)
    (with ``ClockOptions.comm_overlap`` False — a CPU, where gloo shares the cores — nothing
    is hidden: dp and cp are fully exposed)
    T_step = T_pipe + dp + opt;  tokens/s = global tokens / T_step;
    with more ranks than run at once on a CPU (``Hardware.cores``, this-machine):
    T_step = max(T_step, world · (m·(t_f + t_b + t_rc) + opt) / cores + the waits on
             communication + the runtime's per-step cost)  (the difference: ``time_shared``)
    MFU    = model FLOPs per token · tokens/s / (world · peak)

Each collective costs ``hardware.collective_seconds`` on the intra-node link when its group
sits inside one node, else on the inter-node link at g × one NIC's bandwidth, g = the group's
ranks per node (NCCL runs a ring per NIC; ``ranks_per_node``).

The planner enumerates (tp, cp, pp, v, dp, ep, zero, micro-batch size, recompute), keeps what
``fived.config.validate`` accepts, discards what breaks the iron rule (tp·cp ranks — the groups
that talk every layer — must sit inside one node) or does not fit the device's memory (largest
rank, ``memory.largest_rank``, against ``memory_fraction`` of the device), and ranks the rest
by predicted step time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..config import (
    V_SCHEDULES,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    fp8_gather_applies,
    resolve_precision,
    validate,
)
from . import bubble as bubble_formulas
from . import compute as flops
from . import roofline as roofline_model
from .hardware import Hardware, collective_seconds
from .memory import (
    FUSED,
    OPTIMIZER_BYTES,
    ActivationOptions,
    RankMemory,
    candidate_ranks,
    grad_bytes,
    group_sizes,
    master_bytes,
    param_bytes,
    states_floor,
)
from .params import (
    fp8_gather,
    layer_cfg,
    layer_kinds,
    rank_layer_ids,
    rank_layers,
    rank_moe_layers,
    rank_params,
    rank_stages,
)
from .peak import largest_rank
from .traffic import Collective, bytes_by_group, micro_batch_size, step_traffic

GPU_ACTIVATIONS = FUSED

_GROUP_DIMS = {"dense": ("dp", "ep", "cp"), "expert": ("dp", "cp"), "batch": ("dp", "ep"),
               # hybrid sharding (fived.ranks.grid): dp = dp_replicate·N + dp_shard
               "dense_shard": ("dp_shard", "ep", "cp"), "expert_shard": ("dp_shard", "cp"),
               "dp_replicate": ("dp_replicate",),
               # the embedding group: pp 0 and pp − 1, as far apart as the pp group's ends
               "embed": ("pp",)}


def group_dims(name: str) -> tuple[str, ...]:
    return _GROUP_DIMS.get(name, (name,))


def _strides(par: ParallelConfig) -> tuple[dict[str, int], dict[str, int]]:
    """(stride, degree) of every dimension in the grid order, and of dp's two sub-dimensions:
    dp_shard (stride of dp, degree N) inside dp_replicate (stride N·dp's, degree M)."""
    stride, strides = 1, {}
    for d in reversed(par.order):
        strides[d] = stride
        stride *= par.degree(d)
    degrees = {d: par.degree(d) for d in par.order}
    n = par.shard_degree if par.hybrid else par.dp
    strides["dp_shard"], strides["dp_replicate"] = strides["dp"], strides["dp"] * n
    degrees["dp_shard"], degrees["dp_replicate"] = n, par.dp // n
    return strides, degrees


def inside_node(par: ParallelConfig, group: str, gpus_per_node: int) -> bool:
    """Whether the group over ``group``'s dims (grid order ``par.order``) stays on one node:
    the span of rank 0's group, Σ stride·(degree−1), is below ``gpus_per_node``."""
    strides, degrees = _strides(par)
    span = sum(strides[d] * (degrees[d] - 1) for d in group_dims(group))
    return span < gpus_per_node


def ranks_per_node(par: ParallelConfig, group: str, gpus_per_node: int) -> int:
    """How many of rank 0's ``group`` sit on rank 0's node (ranks 0 .. gpus_per_node−1)."""
    strides, degrees = _strides(par)
    ranks = [0]
    for d in group_dims(group):
        ranks = [r + i * strides[d] for r in ranks for i in range(degrees[d])]
    return max(1, sum(1 for r in ranks if r < gpus_per_node))


def link(hw: Hardware, par: ParallelConfig, group: str, gpus_per_node: int) -> tuple[float, float,
                                                                                    str]:
    """(bandwidth, latency, name) of the link a group's ring runs on. Across nodes, NCCL runs
    one ring per NIC: with g of the group's ranks on each node, g NICs carry it, so its bus
    bandwidth is g × one NIC's (at most the intra-node link's)."""
    if inside_node(par, group, gpus_per_node):
        return hw.intra_bw, hw.intra_latency, "intra"
    g = ranks_per_node(par, group, gpus_per_node)
    return min(hw.intra_bw, g * hw.inter_bw), hw.inter_latency, "inter"


@dataclass
class Prediction:
    par: ParallelConfig
    micro_batch: int
    global_batch: int
    memory: RankMemory
    device_memory: float
    times: dict[str, float]  # seconds per step by component
    step_seconds: float
    tokens_per_s: float
    mfu: float
    bubble: float  # fraction of the step
    traffic: dict[str, float]  # bytes per step by group (slowest rank)
    collectives: list[tuple[Collective, str, float]] = field(default_factory=list)
    slow_rank: int = 0
    optimizer: str = "adamw"  # the --optimizer whose state and traffic are counted

    @property
    def fits(self) -> bool:
        """The step's peak (``fived.ledger.peak``), not only what the rank keeps."""
        return self.memory.peak <= self.device_memory

    def name(self) -> str:
        name = layout_name(self.par, self.micro_batch)
        return name if self.optimizer == "adamw" else f"{name} {self.optimizer}"

    def as_dict(self) -> dict:
        p = self.par
        return {
            "layout": self.name(),
            "parallel": {"tp": p.tp, "cp": p.cp, "ep": p.ep, "dp": p.dp, "pp": p.pp,
                         "virtual_stages": p.virtual_stages, "schedule": p.schedule,
                         "zero": p.zero, "dp_shard": p.shard_degree,
                         "dp_replicate": p.replicate_degree, "sequence_parallel": p.sequence_parallel,
                         "recompute": p.recompute, "precision": p.precision,
                         "grad_reduce_dtype": p.grad_reduce_dtype, "cp_mode": p.cp_mode,
                         "bucket_mb": p.bucket_mb, "overlap": p.overlap, "order": list(p.order),
                         "micro_batches": p.micro_batches},
            "micro_batch_size": self.micro_batch, "global_batch": self.global_batch,
            "memory": self.memory.as_dict(), "device_memory": self.device_memory,
            "fits": self.fits, "times": self.times, "step_seconds": self.step_seconds,
            "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "bubble": self.bubble,
            "traffic_bytes": self.traffic, "slowest_pp_rank": self.slow_rank,
            "collectives": [dict(c.as_dict(), link=lk, seconds=s)
                            for c, lk, s in self.collectives],
        }


def layout_name(par: ParallelConfig, micro_batch: int) -> str:
    parts = [f"{d}{par.degree(d)}" for d in ("tp", "cp", "ep", "pp", "dp") if par.degree(d) > 1]
    if par.hybrid:  # dp = N shard × M replicate
        parts[-1] += f"({par.shard_degree}s×{par.replicate_degree}r)"
    if par.pp > 1 and par.schedule == "interleaved":
        parts.append(f"v{par.virtual_stages}")
    elif par.pp > 1 and par.schedule != "1f1b":
        parts.append(par.schedule)
    if par.zero:
        parts.append(f"zero{par.zero}")
    if par.sequence_parallel:
        parts.append("sp")
    parts.append(f"b{micro_batch}")
    if par.recompute != "none":
        parts.append(f"rc-{par.recompute}")
    return "·".join(parts)


def aggregate(colls: list[Collective]) -> list[Collective]:
    """Merge collectives that differ only in their count (e.g. equal buckets, one per layer)."""
    out: dict[tuple, Collective] = {}
    for c in colls:
        key = (c.group, c.op, c.size, c.n, c.what, c.phase)
        prev = out.get(key)
        out[key] = c if prev is None else Collective(c.group, c.op, c.size, c.n,
                                                    prev.count + c.count, c.what, c.phase)
    return list(out.values())


def _flat_compute(m: ModelConfig, par: ParallelConfig, hw: Hardware, b: int, r: int,
                  efficiency: float) -> dict[str, float]:
    """The old clock (``--efficiency X``): forward FLOPs at one fraction of peak, backward 2×."""
    rate = hw.matmul_peak(par.precision) * efficiency
    tokens_mb = b * m.seq_len / par.cp
    n_stages = par.pp * max(1, par.virtual_stages)
    layers = rank_layers(m, par, r)
    last = (n_stages - 1) in rank_stages(par, r)
    f = flops.stage_forward_flops_per_token(m, rank_layer_ids(m, par, r), last) * tokens_mb / par.tp
    if m.is_moe:  # experts are replicated over tp: without SP each tp rank runs all tokens
        sp_div = par.tp if par.sequence_parallel else 1
        ex = (2.0 * 3 * m.hidden * m.expert_ffn * m.top_k * rank_moe_layers(m, par, r)
              * tokens_mb)
        f += ex / sp_div - ex / par.tp
    t_f = f / rate
    core = flops.attention_flops_per_token(m, layers=layers) * tokens_mb / par.tp / rate
    if par.recompute == "full":
        rc = t_f - (2.0 * m.hidden * m.vocab * tokens_mb / par.tp / rate if last else 0.0)
    else:
        rc = core if par.recompute == "selective" else 0.0
    return {"fwd": t_f, "bwd": 2 * t_f, "recompute": rc, "attn_core": core,
            "gemm": 3 * t_f, "memory_bound": 0.0}


def rank_compute(m: ModelConfig, par: ParallelConfig, hw: Hardware, b: int, r: int,
                 efficiency: float | None = None,
                 clock: roofline_model.ClockOptions | None = None) -> dict[str, float]:
    """One micro-batch's compute seconds on pipeline rank ``r``: the roofline clock, or the
    flat ``efficiency`` when one is given."""
    if efficiency is not None:
        return _flat_compute(m, par, hw, b, r, efficiency)
    n_stages = par.pp * max(1, par.virtual_stages)
    stages = rank_stages(par, r)
    first, last = 0 in stages, (n_stages - 1) in stages
    out: dict[str, float] = {}
    # each block priced with its own shape (first_dense_layers: the dense ones as dense); the
    # stage's ends (embedding, head, loss) once, with the first kind
    for j, (shape, n) in enumerate(layer_kinds(m, rank_layer_ids(m, par, r))):
        t = roofline_model.micro_batch_times(shape, par, b, hw, n, first and j == 0, last and j == 0,
                                clock or roofline_model.ClockOptions())
        for k, v in t.items():
            out[k] = out.get(k, 0.0) + v
    # each multi-token prediction module on the last rank: its block, output norm, the shared
    # head and the loss (eh_proj's 2h -> h GEMM is not timed)
    for j in range(m.mtp_depth if last else 0):
        t = roofline_model.micro_batch_times(layer_cfg(m, m.layers + j), par, b, hw, 1, False,
                                             True, clock or roofline_model.ClockOptions())
        for k, v in t.items():
            out[k] = out.get(k, 0.0) + v
    return out


def predict(m: ModelConfig, par: ParallelConfig, hw: Hardware, global_batch: int,
            gpus_per_node: int | None = None, efficiency: float | None = None,
            memory_fraction: float = 0.9,
            opts: ActivationOptions = GPU_ACTIVATIONS, optimizer: str = "adamw",
            clock: roofline_model.ClockOptions | None = None) -> Prediction:
    """Memory, traffic and time of one layout (see the module docstring)."""
    par = resolve_precision(par, hw.gpu, hw.name)[0]  # --precision auto, by the hardware
    gpn = gpus_per_node or hw.gpus_per_node
    clock = clock or roofline_model.ClockOptions(attention=opts.attention)
    b = micro_batch_size(par, global_batch)
    mem = largest_rank(m, par, b, opts, optimizer)
    mb = par.micro_batches
    best = None
    for r in range(par.pp) if par.pp <= 64 else (0, par.pp - 1):
        ct = rank_compute(m, par, hw, b, r, efficiency, clock)
        busy = ct["fwd"] + ct["bwd"] + ct["recompute"]
        if best is None or busy > best[1]:
            best = (r, busy, ct)
    r, _, ct = best
    t_f, t_b, t_rc, attn_core = ct["fwd"], ct["bwd"], ct["recompute"], ct["attn_core"]
    colls = aggregate(step_traffic(m, par, b, r, optimizer))
    timed: list[tuple[Collective, str, float]] = []
    per: dict[tuple[str, str], float] = {}
    links: dict[str, tuple[float, float, str]] = {}
    for c in colls:
        if c.group not in links:
            links[c.group] = link(hw, par, c.group, gpn)
        bw, lat, lk = links[c.group]
        s = c.count * collective_seconds(c.op, c.size, c.n, bw, lat)
        timed.append((c, lk, s))
        key = (c.group, c.phase)
        per[key] = per.get(key, 0.0) + s
    tp = sum(v for (g, _), v in per.items() if g == "tp") / mb
    if clock.tp_overlap:  # chunked collectives run under the matmuls they feed
        tp = max(0.0, tp - ct["gemm"])
    ep = sum(v for (g, _), v in per.items() if g == "ep") / mb
    cp = sum(v for (g, _), v in per.items() if g == "cp") / mb
    cp = max(0.0, cp - 3 * attn_core) if clock.comm_overlap else cp
    pp = sum(v for (g, _), v in per.items() if g == "pp") / mb
    dp_groups = ("dense", "expert", "dense_shard", "expert_shard", "dp_replicate")
    overlap = par.overlap and clock.comm_overlap
    zero_mb = 0.0
    dp_step = 0.0
    if par.zero == 3:
        fwd_g = sum(per.get((g, "fwd"), 0.0) for g in dp_groups) / mb
        bwd_g = sum(per.get((g, "bwd"), 0.0) for g in dp_groups) / mb
        zero_mb = (max(0.0, fwd_g - t_f) + max(0.0, bwd_g - t_b)) if overlap else fwd_g + bwd_g
    elif par.zero == 2:
        rs = sum(per.get((g, "bwd"), 0.0) for g in dp_groups) / mb
        zero_mb = max(0.0, rs - t_b) if overlap else rs
        ag = sum(per.get((g, "step"), 0.0) for g in dp_groups)
        dp_step = max(0.0, ag - t_f) if overlap else ag
    else:
        red = sum(per.get((g, "bwd"), 0.0) for g in dp_groups)
        ag = sum(per.get((g, "step"), 0.0) for g in dp_groups)
        dp_step = (max(0.0, red - t_b) + max(0.0, ag - t_f)) if overlap else red + ag
    t_mb = t_f + t_b + t_rc + tp + ep + cp + pp + zero_mb
    ticks = bubble_formulas.bubble_ticks(par)
    if efficiency is None:
        t_opt = roofline_model.optimizer_seconds(mem.states_total, hw)
    else:
        t_opt = 2.0 * mem.states_total / hw.hbm_bw
    step = (mb + ticks) * t_mb + dp_step + t_opt + hw.step_overhead
    # ranks sharing a CPU's cores (this-machine): while some wait (bubble, communication)
    # others run, but the step is at least every rank's busy time over the ranks that run at
    # once, plus the communication all of them wait on together
    shared = 0.0
    if hw.cores and par.world_size > hw.cores:
        busy = mb * (t_f + t_b + t_rc) + t_opt
        waits = mb * (tp + ep + cp + pp + zero_mb) + dp_step
        shared = max(0.0, par.world_size * busy / hw.cores + waits + hw.step_overhead - step)
        step += shared
    mem_bound = mb * ct["memory_bound"]
    times = {
        "compute": mb * (t_f + t_b) - mem_bound, "memory_bound": mem_bound,
        "recompute": mb * t_rc, "tp": mb * tp, "ep": mb * ep,
        "cp": mb * cp, "pp_p2p": mb * pp, "zero_per_micro": mb * zero_mb,
        "bubble": ticks * t_mb, "dp": dp_step, "optimizer": t_opt,
        "runtime": hw.step_overhead, "time_shared": shared,
    }
    tokens = global_batch * m.seq_len
    tps = tokens / step
    mfu = flops.model_flops_per_token(m) * tps / (par.world_size * hw.matmul_peak(par.precision))
    return Prediction(par, b, global_batch, mem, hw.memory * memory_fraction, times, step, tps,
                      mfu, bubble_formulas.bubble_fraction(par), bytes_by_group(colls), timed, r, optimizer)


# ------------------------------------------------------------------------ the search
CLUSTER_TOKENS = 4 * 2**20  # a GPU run's global batch when none is given: about 4M tokens


def cluster_batch(gpus: int, default: int, multiple: int = 1, seq_len: int | None = None) -> int:
    """The global batch (sequences) of a cluster when none is given: ``fived plan`` and
    ``fived ledger`` alike. The training default (16 sequences) caps data parallelism at 16, so
    on a cluster the batch grows with it: a quarter of the GPUs rounded down to a power of two
    (8,192 GPUs: 2,048 sequences, Llama 3's), at least ``default``; with ``seq_len`` (a GPU
    preset) at least ``CLUSTER_TOKENS`` tokens as a power of two of sequences (Llama 2's and
    Llama 3's early batches: 4M tokens); then rounded up to a ``multiple`` (the ledger's fixed
    layout: dp·ep·micro-batches; the plan searches it: 1)."""
    auto = max(default, 1 << max(0, (max(gpus, 1) // 4).bit_length() - 1))
    if seq_len:
        auto = max(auto, 1 << max(0, (CLUSTER_TOKENS // seq_len).bit_length() - 1))
    return -(-auto // multiple) * multiple


def _pow2_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def shard_degrees(dp: int, others_in_node: int, gpus_per_node: int, zero: int,
                  ep_cp: int = 1) -> list[int]:
    """The ``--dp-shard`` values the search tries for one layout (hybrid sharding): 0 (flat:
    ZeRO over all of dp), and N < dp dividing dp among 1, the node size (the largest N whose
    shard group of N·tp·cp·ep ranks fits in a node) and twice it (a shard group over two nodes).
    Larger multiples are not tried: each doubles the layouts the search evaluates for a
    memory × dp/N the flat layout already beats (docs/ledger.md). N = 1 with ``ep_cp`` (= ep·cp)
    1 is left out: a shard group of one rank is DDP's memory and all-reduce, which ZeRO-0
    already covers. ZeRO-0 shards nothing: only flat."""
    if zero == 0 or dp <= 1:
        return [0]
    fit = max(1, gpus_per_node // max(1, others_in_node))
    node = max(k for k in _divisors(dp) if k <= fit)
    want = {node, 2 * node} | ({1} if ep_cp > 1 else set())
    return [0] + sorted(k for k in want if k < dp and dp % k == 0)


@dataclass
class PlanResult:
    ranked: list[Prediction]
    counts: dict[str, int]
    smallest_unfit: Prediction | None = None  # set only when nothing fits
    reasons: list[str] = field(default_factory=list)


def cp_modes(m: ModelConfig, cp: int, fixed: dict) -> list[dict]:
    """The context-parallel cores a layout of ``cp`` ranks is tried with: an MLA model's two
    rings, the decompressed heads' and the latent's (the clock weighs the latent's fewer bytes
    against its up-projections), unless ``fixed`` names one; else the one ``fixed`` keeps."""
    if cp > 1 and m.is_mla and "cp_mode" not in fixed:
        return [{"cp_mode": "ring"}, {"cp_mode": "ring-latent"}]
    return [{}]


def candidates(m: ModelConfig, gpus: int, gpus_per_node: int, global_batch: int,
               precision: str = "bf16", grad_reduce_dtype: str = "fp32",
               schedules: tuple[str, ...] = ("1f1b", "interleaved"),
               micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8),
               recomputes: tuple[str, ...] = ("none", "selective", "full"),
               zeros: tuple[int, ...] = (0, 1, 2, 3), max_virtual: int = 4,
               counts: dict[str, int] | None = None, fixed: dict | None = None,
               hybrid: bool = True):
    """Yield every (ParallelConfig, micro-batch size) the search considers; ``counts`` tallies
    what is discarded before any prediction (invalid, iron rule); ``fixed``: fields every
    layout keeps (a --config's cp_mode, bucket_mb, overlap, order); ``hybrid``: also try
    hybrid sharding's shard degrees (``shard_degrees``) for every ZeRO stage."""
    fixed = fixed or {}
    counts = counts if counts is not None else {}
    tps = _pow2_upto(min(gpus, max(gpus_per_node, 1) * 2))
    eps = _divisors(m.experts) if m.is_moe else [1]
    for tp in tps:
        for cp in _pow2_upto(gpus // tp):
            if tp * cp > gpus_per_node:
                counts["iron_rule"] = counts.get("iron_rule", 0) + 1
                continue
            for ep in eps:
                rest = gpus // (tp * cp)
                if rest * tp * cp != gpus or rest % ep:
                    continue
                for pp in _divisors(rest // ep):
                    dp = rest // ep // pp
                    if global_batch % (dp * ep):
                        counts["batch"] = counts.get("batch", 0) + 1
                        continue
                    per_replica = global_batch // (dp * ep)
                    scheds = [("1f1b", 1)] if pp == 1 else []
                    if pp > 1:
                        for s in schedules:
                            if s == "interleaved":
                                scheds += [(s, v) for v in (2, 4, 8) if v <= max_virtual]
                            elif s in V_SCHEDULES:
                                scheds.append((s, 2))
                            else:
                                scheds.append((s, 1))
                    for sched, v in scheds:
                        stages = pp * v
                        if stages > m.layers:
                            continue
                        # any pp·v: without --pp-layers the runtime, the ledger and the dry run
                        # cut by the one balanced split (params.balanced_split), e.g. 126 / 16
                        split = ()
                        for b in micro_batch_sizes:
                            if per_replica % b:
                                continue
                            mbs = per_replica // b
                            for zero, shard in [
                                    (z, k) for z in (zeros if dp * ep * cp > 1 else (0,))
                                    for k in (shard_degrees(dp, tp * cp * ep, gpus_per_node, z, ep * cp)
                                              if hybrid else [0])]:
                                for rc, mode in [(r, c) for r in recomputes
                                                 for c in cp_modes(m, cp, fixed)]:
                                    par = ParallelConfig(
                                        tp=tp, cp=cp, ep=ep, dp=dp, pp=pp, zero=zero,
                                        dp_shard=shard,
                                        schedule=sched, virtual_stages=v, micro_batches=mbs,
                                        sequence_parallel=tp > 1, recompute=rc,
                                        precision=precision, grad_reduce_dtype=grad_reduce_dtype,
                                        pp_layers=split, **mode, **fixed)
                                    if not par.fp8_gather and not fp8_gather_applies(par):
                                        # --no-fp8-gather where nothing gathers in fp8
                                        par = replace(par, fp8_gather=True)
                                    try:
                                        validate(m, par)
                                    except ConfigError:
                                        counts["invalid"] = counts.get("invalid", 0) + 1
                                        continue
                                    yield par, b


def memory_bound(m: ModelConfig, par: ParallelConfig, micro_batch: int | None = None,
                 optimizer: str = "adamw", opts: ActivationOptions = GPU_ACTIVATIONS) -> float:
    """A lower bound on the step's peak of the largest rank (``peak.largest_rank(...).peak``)
    in closed form: for each compared rank, its parameters (``params.rank_params``) times
    the bytes per element its ZeRO stage keeps (ZeRO-1/2's fp8 gather: the parameters at
    min(P, 1 + P/N) each), without the buckets' padding (never negative)
    and, for an optimizer other than AdamW, without its state — at most what the rank keeps
    through every phase; with ``micro_batch``, plus one micro-batch's saved activations of
    its largest stage (``memory.stage_activation_bytes``), which that stage's forward and
    backward phases hold. The search drops a layout above the device with this alone, before
    the buckets (tens of thousands of tensors for a large MoE) are cut and its step replayed."""
    from .memory import stage_activation_bytes

    z = par.zero
    pb, gb, mb = param_bytes(par), grad_bytes(par), master_bytes(par)
    ob = OPTIMIZER_BYTES if optimizer == "adamw" else 0
    sizes = group_sizes(par)
    gather8 = z in (1, 2) and fp8_gather(par)
    best = 0.0
    for r in candidate_ranks(par):
        rp = rank_params(m, par, r)
        total = 0.0
        for numel, group in ((rp.dense, "dense"), (rp.expert, "expert")):
            n = sizes[group] if z and sizes[group] > 1 else 1
            # ZeRO-1/2's fp8 gather keeps its fp8 weights as 1 + P/N bytes: every element at
            # the lesser of the two stays a lower bound
            p = min(pb, 1 + pb / n) if gather8 and n > 1 else pb
            total += numel * (p * (1 if z < 3 else 1 / n) + gb * (1 if z <= 1 else 1 / n)
                              + (mb + ob) * (1 if z == 0 else 1 / n))
        if micro_batch is not None:
            total += max((stage_activation_bytes(m, par, micro_batch, s, opts)
                          for s in rank_stages(par, r)), default=0.0)
        best = max(best, total)
    return best


def plan(m: ModelConfig, gpus: int, hw: Hardware, global_batch: int,
         gpus_per_node: int | None = None, efficiency: float | None = None,
         memory_fraction: float = 0.9, top: int = 10, optimizer: str | tuple[str, ...] = "adamw",
         clock: roofline_model.ClockOptions | None = None,
         progress: Callable[[int, int | None], None] | None = None, **space
         ) -> PlanResult:
    """Every layout that fits, fastest first (``ranked``), with what was discarded;
    ``optimizer``: one ``--optimizer`` or several, each layout evaluated with each;
    ``progress(done, total)``: called as the layouts are enumerated (``total`` None, every
    500) and as they are evaluated (about every 1 %).

    A layout whose kept states and one micro-batch's activations alone exceed the device
    (``memory_bound``, then ``memory.states_floor``) is out of memory without its buffers, traffic or clock
    being worked out: the same answer as evaluating it, since both are lower bounds. Only
    when no layout fits are those evaluated in full, in the order of their bounds until the
    bound passes the smallest found, for the smallest that does not fit."""
    optimizers = (optimizer,) if isinstance(optimizer, str) else tuple(optimizer)
    gpn = gpus_per_node or hw.gpus_per_node
    counts: dict[str, int] = {}
    fits: list[Prediction] = []
    floored: list[tuple[float, int]] = []  # out of memory: (bytes or a lower bound, place)
    cap = hw.memory * memory_fraction
    jobs = []
    for k, (par, _b) in enumerate(candidates(m, gpus, gpn, global_batch, counts=counts,
                                             **space)):
        if progress and k % 500 == 0:
            progress(k, None)  # still enumerating: the total is not known yet
        jobs += [(par, opt) for opt in optimizers]
    every = max(1, len(jobs) // 100)

    def full(par: ParallelConfig, opt: str) -> Prediction:
        return predict(m, par, hw, global_batch, gpn, efficiency, memory_fraction,
                       optimizer=opt, clock=clock)

    for i, (par, opt) in enumerate(jobs):
        if progress and i % every == 0:
            progress(i, len(jobs))
        # lower bounds first (closed form, then the cut buckets): a layout above the device
        # by either is out of memory whatever its buffers, traffic or clock
        rpar = resolve_precision(par, hw.gpu, hw.name)[0]
        bound = memory_bound(m, rpar, micro_batch_size(rpar, global_batch), opt)
        if bound <= cap:
            bound = max(bound, states_floor(m, rpar, opt))
        if bound > cap:
            floored.append((bound, i))
            continue
        # the memory before the clock: a layout that does not fit needs no traffic or time
        mem = largest_rank(m, rpar, micro_batch_size(rpar, global_batch), GPU_ACTIVATIONS, opt)
        if mem.peak > cap:
            floored.append((mem.peak, i))
            continue
        fits.append((step_lower_bound(m, rpar, hw, global_batch, mem, efficiency, clock), i))
    if progress:
        progress(len(jobs), len(jobs))
    fitting = [jobs[i][0] for _, i in fits]
    fits = _cost(fits, fitting, lambda i: full(*jobs[i]), top)  # type: ignore[assignment]
    smallest = None
    if not fits:  # the smallest that does not fit, over every layout (the first of a tie):
        # in the order of their lower bounds until the bound passes the smallest found
        best: tuple[float, int] | None = None
        for bound, i in sorted(floored):
            if best is not None and bound > best[0]:
                break
            par, opt = jobs[i]
            rpar = resolve_precision(par, hw.gpu, hw.name)[0]
            peak = largest_rank(m, rpar, micro_batch_size(rpar, global_batch),
                                GPU_ACTIVATIONS, opt).peak
            best = min(best or (peak, i), (peak, i))
        smallest = full(*jobs[best[1]]) if best else None
    counts["evaluated"] = len(jobs)
    if len(jobs) > len(fitting):
        counts["out_of_memory"] = len(jobs) - len(fitting)
    fits = rank_layouts(fits)
    counts["fit"] = len(fitting)
    counts["timed"] = len(fits)
    res = PlanResult(fits, counts, smallest)
    res.reasons = explain(fits)
    return res


def step_lower_bound(m: ModelConfig, par: ParallelConfig, hw: Hardware, global_batch: int,
                     mem: RankMemory, efficiency: float | None = None,
                     clock: roofline_model.ClockOptions | None = None) -> float:
    """A lower bound on ``predict(...).step_seconds`` without the traffic: the slowest
    pipeline rank's compute, (micro-batches + bubble ticks) times, plus the optimizer step
    and the runtime's cost (``predict`` adds the exposed communication and the CPU's shared
    time, never negative)."""
    clock = clock or roofline_model.ClockOptions(attention=GPU_ACTIVATIONS.attention)
    b = micro_batch_size(par, global_batch)
    busy = max(sum(rank_compute(m, par, hw, b, r, efficiency, clock)[k]
                   for k in ("fwd", "bwd", "recompute"))
               for r in (range(par.pp) if par.pp <= 64 else (0, par.pp - 1)))
    t_opt = (roofline_model.optimizer_seconds(mem.states_total, hw) if efficiency is None
             else 2.0 * mem.states_total / hw.hbm_bw)
    return ((par.micro_batches + bubble_formulas.bubble_ticks(par)) * busy + t_opt
            + hw.step_overhead)


# what ``explain`` reads beyond the top: the best of each family
FAMILIES = (lambda p: p.pp == 1, lambda p: p.tp == 1, lambda p: p.recompute == "none")


def _cost(bounded: list[tuple[float, int]], fitting: list[ParallelConfig], full, top: int
          ) -> list[Prediction]:
    """Predict the layouts that fit in the order of their step-time lower bounds, until the
    next bound is above every step the answer reads (the ``top``-th fastest, the best of each
    family ``explain`` names, the best of another shape), widened by ``TIE``: a layout
    left out is slower than all of them, so the ranking's first ``top`` and ``explain`` are
    those of predicting every layout (``rank_layouts`` only reorders within a tie)."""
    order = sorted(range(len(bounded)), key=lambda k: bounded[k])
    has = [any(f(p) for p in fitting) for f in FAMILIES]
    shapes = {_shape(p) for p in fitting}
    out: list[Prediction] = []
    limit = float("inf")
    for n, k in enumerate(order):
        bound, i = bounded[k]
        if bound > limit:
            break
        out.append(full(i))
        if n % 16 == 15 or n == len(order) - 1 or len(out) >= top:
            limit = _limit(out, has, len(shapes) > 1, top)
    return out


def _limit(out: list[Prediction], has: list[bool], shapes: bool, top: int) -> float:
    """The step below which every layout must be predicted (``_cost``)."""
    steps = sorted(p.step_seconds for p in out)
    if len(steps) < max(top, 2):
        return float("inf")
    need = [steps[max(top, 2) - 1]]
    for f, h in zip(FAMILIES, has):
        if h:
            need.append(min((p.step_seconds for p in out if f(p.par)), default=float("inf")))
    if shapes:  # the best of another shape than the winner's: at most the second shape's
        by: dict[tuple, float] = {}
        for p in out:
            by[_shape(p.par)] = min(by.get(_shape(p.par), float("inf")), p.step_seconds)
        need.append(sorted(by.values())[1] if len(by) > 1 else float("inf"))
    return max(need) * (1 + TIE) ** 2


TIE = 0.002  # step times within 0.2 % are a tie for the model


def rank_layouts(preds: list[Prediction]) -> list[Prediction]:
    """Fastest first; runs of layouts within ``TIE`` of the run's fastest are a tie, ordered
    by the bytes they send per step, then by memory."""
    preds = sorted(preds, key=lambda p: p.step_seconds)
    out: list[Prediction] = []
    i = 0
    while i < len(preds):
        j = i
        while j < len(preds) and preds[j].step_seconds <= preds[i].step_seconds * (1 + TIE):
            j += 1
        out += sorted(preds[i:j], key=lambda p: (sum(p.traffic.values()), p.memory.peak))
        i = j
    return out


def _shape(p: ParallelConfig) -> tuple:
    return (p.tp, p.cp, p.ep, p.pp, p.dp)


def _family_best(ranked: list[Prediction], pred, label: str) -> str | None:
    for p in ranked:
        if pred(p.par):
            return f"best {label}: {p.name()} at {p.step_seconds:.3f} s/step " \
                   f"({ranked[0].step_seconds / p.step_seconds:.0%} of the winner's speed)"
    return f"no layout {label} fits"


def _shard_reason(ranked: list[Prediction]) -> list[str]:
    """Why the winner's shard degree (hybrid sharding): the same layout with each other shard
    degree the search tried, its step time and memory, or why none fits."""
    from dataclasses import replace

    best = ranked[0]
    if not best.par.zero:
        return []
    flat = replace(best.par, dp_shard=0)
    alts = [p for p in ranked if p is not best and replace(p.par, dp_shard=0) == flat
            and p.micro_batch == best.micro_batch and p.optimizer == best.optimizer]
    what = (f"dp-shard {best.par.shard_degree} × dp-replicate {best.par.replicate_degree}"
            if best.par.hybrid else f"flat ZeRO over dp {best.par.dp}")
    if not alts:
        return [f"shard degree: {what}; no other shard degree of this layout fits (states "
                f"÷ N grow as N shrinks)."]
    bits = [f"{'flat' if not p.par.hybrid else f'dp-shard {p.par.shard_degree}'} "
            f"{p.step_seconds:.3f} s, {p.memory.peak / 1e9:.1f} GB" for p in alts[:3]]
    return [f"shard degree: {what} ({best.step_seconds:.3f} s, "
            f"{best.memory.peak / 1e9:.1f} GB) against {'; '.join(bits)}."]


def explain(ranked: list[Prediction]) -> list[str]:
    """Why the best layout wins, in sentences built from the time components."""
    if not ranked:
        return ["no layout fits: add GPUs, raise ZeRO/tp/pp, or recompute"]
    best = ranked[0]
    t = best.times
    out = [f"{best.name()} fits: largest rank (pp rank {best.memory.pp_rank}) needs "
           f"{best.memory.peak / 1e9:.1f} GB of {best.device_memory / 1e9:.1f} GB usable."]
    parts = sorted(((k, v) for k, v in t.items() if v > 0), key=lambda kv: -kv[1])
    share = ", ".join(f"{k} {v / best.step_seconds:.0%}" for k, v in parts[:5])
    out.append(f"its step ({best.step_seconds:.3f} s) is {share}; MFU {best.mfu:.1%}.")
    if len(ranked) > 1:
        run = ranked[1]
        deltas = sorted(((k, run.times.get(k, 0.0) - v) for k, v in t.items()),
                        key=lambda kv: -kv[1])
        gains = [f"{k} −{d * 1e3:.1f} ms" for k, d in deltas if d > 0][:3]
        losses = [f"{k} +{-d * 1e3:.1f} ms" for k, d in deltas[::-1] if d < 0][:2]
        if abs(run.step_seconds / best.step_seconds - 1) <= TIE:
            saved = sum(run.traffic.values()) - sum(best.traffic.values())
            out.append(f"runner-up {run.name()} ties within {TIE:.1%} of the step time; the "
                       f"winner sends {saved / 1e9:.1f} GB less per rank per step "
                       f"(memory {best.memory.peak / 1e9:.1f} GB against "
                       f"{run.memory.peak / 1e9:.1f} GB).")
        else:
            out.append(f"runner-up {run.name()} is "
                       f"{run.step_seconds / best.step_seconds - 1:.1%} slower; the winner saves "
                       f"{', '.join(gains) or 'nothing'}"
                       + (f" and pays {', '.join(losses)}" if losses else "") + ".")
    other = next((p for p in ranked if _shape(p.par) != _shape(best.par)), None)
    if other is not None and other is not ranked[1]:
        out.append(f"best other shape: {other.name()} is "
                   f"{other.step_seconds / best.step_seconds - 1:.1%} slower "
                   f"(largest rank {other.memory.peak / 1e9:.1f} GB).")
    out += _shard_reason(ranked)
    for pred, label in ((lambda p: p.pp == 1, "without pipeline parallelism"),
                        (lambda p: p.tp == 1, "without tensor parallelism"),
                        (lambda p: p.recompute == "none", "without recompute")):
        if not pred(best.par):
            s = _family_best(ranked, pred, label)
            if s:
                out.append(s + ".")
    return out


