"""Hardware presets and the alpha-beta cost of a collective.

A collective of ``op`` on ``n`` ranks over a link with latency α (seconds per step) and
bandwidth β (bytes per second each rank can put on the wire, nccl-tests' bus bandwidth) costs

    t = steps(op, n)·α + bytes_sent(op, S, n) / β

with ring steps 2(n−1) for all_reduce, n−1 for all_gather / reduce_scatter / all_to_all, 1 for
a send (Hockney 1994; Thakur et al. 2005). A group whose ranks all sit on one node uses the
intra-node link; any other group the inter-node link (the NIC is the ring's bottleneck).

The presets are nominal vendor figures, rounded (dense bf16 tensor FLOP/s without sparsity,
memory, HBM bandwidth; intra-node = achievable NVLink bus bandwidth, inter-node = one NIC per
GPU). They are starting points to plan with, not measurements: calibrate with
``this_machine`` (``fived bench comm --json`` + a matmul) where the machine is at hand.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace

from ..comm.volume import bytes_sent

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per device (tensor cores, no sparsity)
    memory: float  # bytes per device
    hbm_bw: float  # bytes/s device memory bandwidth
    intra_bw: float  # bytes/s per rank, inside a node
    intra_latency: float  # seconds per ring step, inside a node
    inter_bw: float  # bytes/s per rank, between nodes
    inter_latency: float  # seconds per ring step, between nodes
    gpus_per_node: int = 8
    note: str = ""
    # --- what the roofline clock (``fived.ledger.roofline``) needs
    peak_fp32: float = 0.0  # FLOP/s of fp32 matmuls (0: peak_flops / 16)
    peak_fp8: float = 0.0  # dense fp8 FLOP/s (0: no fp8 tensor cores; fp8 GEMMs at peak_flops)
    gemm_eff: float = 0.80  # the largest square GEMMs' fraction of peak (the curve's ceiling)
    gemm_d0: float = 128.0  # each GEMM dimension d costs a factor d / (d + d0)
    attn_eff: float = 0.55  # flash attention's fraction of peak (forward; backward alike)
    mem_eff: float = 0.80  # achievable fraction of hbm_bw for element-wise kernels
    overhead: float = 0.0  # seconds per kernel/op beyond its roofline time (launch, dispatch)
    # this-machine: how many ranks run at once on the CPU's cores (cores // threads per
    # rank); more are time-shared (0: a device per rank, nothing shared)
    cores: int = 0
    # this-machine: measured (M, N, K, seconds per call) of the shapes a layout runs; a GEMM
    # found here takes its measured time (overhead included) instead of the curve's
    gemm_table: tuple[tuple[float, float, float, float], ...] = ()
    # this-machine: the eager runtime's own cost beyond its kernels, measured on a tiny model
    # (fived.probe.machine): seconds per block per micro-batch (forward + backward), and per
    # micro-batch for the embedding, head and loss; the per-op ``overhead`` is then 0
    block_overhead: float = 0.0
    stage_overhead: float = 0.0
    step_overhead: float = 0.0  # this-machine: the trainer's per-step cost outside the model
    # this-machine: the eager runtime's non-GEMM kernels traced and timed at the layout's
    # shapes (fived.probe.kernels), seconds per micro-batch: block attention fwd, bwd,
    # block element-wise fwd, bwd, first-stage extras fwd, bwd, last-stage extras fwd, bwd.
    # When set, they replace the roofline's attention and memory-bound ops.
    eager: tuple[float, ...] = ()

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def gpu(self) -> bool:
        """A GPU preset (``--precision auto`` is bf16 there); this-machine is not one."""
        return self.name in PRESETS

    def matmul_peak(self, precision: str) -> float:
        """The dense matmul peak of ``precision`` (fp32, bf16/fp16, or "fp8": the fp8 linears'
        GEMMs)."""
        if precision == "fp32":
            return self.peak_fp32 or self.peak_flops / 16
        if precision == "fp8":
            return self.peak_fp8 or self.peak_flops
        return self.peak_flops


# The clock's constants are FITTED on the calibration table (``fived/ledger/runs.toml``;
# ``fived ledger --validate --refit`` reruns the grid search), never per run: gemm_d0 (the
# dimension at which a GEMM reaches half its ceiling per dimension) and flash attention's
# efficiency for every preset, and the ceiling gemm_eff once per GPU generation (Hopper from
# the H100 rows, Ampere from the A100 rows). mem_eff and the per-op overhead are stated, not
# fitted. B200 and RTX PRO 6000 take the Hopper values unvalidated: no public run of theirs is
# in the table.
FIT = {"gemm_d0": 64.0, "attn_eff": 0.35, "mem_eff": 0.80, "overhead": 4e-6}
HOPPER = {**FIT, "gemm_eff": 0.70}  # fitted on the Megatron-Core H100 rows (--refit)
AMPERE = {**FIT, "gemm_eff": 0.75}  # fitted on the Narayanan et al. 2021 A100 rows (--refit)

PRESETS: dict[str, Hardware] = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16 (1979 with sparsity), 1979 dense FP8,
    # 67 TFLOP/s FP32,
    # 80 GB HBM3 at 3.35 TB/s; NVLink 4 900 GB/s total (450 GB/s per direction); DGX H100 has
    # one ConnectX-7 400 Gb/s (50 GB/s) NIC per GPU. Link figures are achievable nccl-tests bus
    # bandwidths, rounded: ~360 GB/s all-reduce in a node, ~45 GB/s per GPU across nodes.
    "h100-sxm": Hardware(
        "h100-sxm", 989e12, 80 * GB, 3.35e12, 360 * GB, 5e-6, 45 * GB, 10e-6, 8,
        "NVLink 4 (450 GB/s per direction), one 400 Gb/s NIC per GPU", peak_fp32=67e12,
        peak_fp8=1979e12, **HOPPER),
    # NVIDIA H200 SXM datasheet: the H100's compute (989 TFLOP/s BF16 dense, 67 FP32), 141 GB
    # HBM3e at 4.8 TB/s; same NVLink 4 and 400 Gb/s NICs in an HGX H200.
    "h200": Hardware(
        "h200", 989e12, 141 * GB, 4.8e12, 360 * GB, 5e-6, 45 * GB, 10e-6, 8,
        "H100 compute with 141 GB HBM3e; NVLink 4, 400 Gb/s NIC per GPU", peak_fp32=67e12,
        peak_fp8=1979e12, **HOPPER),
    # NVIDIA H800 SXM5 (the export variant DeepSeek-V3 trained on): the H100 SXM5's compute and
    # memory (989 TFLOP/s BF16 dense, 1979 FP8, 80 GB HBM3 at 3.35 TB/s) with NVLink cut to
    # 400 GB/s total. DeepSeek-V3's report (§3.2.2) states its links as used: NVLink 160 GB/s,
    # InfiniBand 50 GB/s per GPU (one 400 Gb/s NIC); 160 GB/s is taken as the achievable bus
    # bandwidth in a node, 45 GB/s across nodes as for the H100's identical NIC.
    "h800": Hardware(
        "h800", 989e12, 80 * GB, 3.35e12, 160 * GB, 5e-6, 45 * GB, 10e-6, 8,
        "H100 compute with NVLink at 400 GB/s total (160 GB/s achievable, DeepSeek-V3 report), "
        "one 400 Gb/s NIC per GPU", peak_fp32=67e12, peak_fp8=1979e12, **HOPPER),
    # NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s BF16 dense, 19.5 TFLOP/s FP32, 80 GB HBM2e
    # at 2.039 TB/s; NVLink 3 600 GB/s total (300 per direction); DGX A100: 8 HDR 200 Gb/s
    # (25 GB/s) NICs, one per GPU (the Selene nodes of Narayanan et al. 2021).
    "a100-80gb": Hardware(
        "a100-80gb", 312e12, 80 * GB, 2.0e12, 230 * GB, 6e-6, 22 * GB, 12e-6, 8,
        "NVLink 3 (300 GB/s per direction), one 200 Gb/s NIC per GPU", peak_fp32=19.5e12,
        **AMPERE),
    # NVIDIA HGX B200 datasheet: 2.25 PFLOP/s dense BF16 per GPU (4.5 with sparsity), 180 GB
    # HBM3e at 8 TB/s (the datasheet's 7.7 TB/s on some SKUs), NVLink 5 1.8 TB/s total (900 GB/s
    # per direction); 400 Gb/s ConnectX-7 per GPU. FP32 75 TFLOP/s.
    "b200": Hardware(
        "b200", 2.25e15, 180 * GB, 8.0e12, 720 * GB, 5e-6, 45 * GB, 10e-6, 8,
        "NVLink 5 (900 GB/s per direction), one 400 Gb/s NIC per GPU", peak_fp32=75e12,
        peak_fp8=4.5e15, **HOPPER),
    # NVIDIA RTX PRO 6000 Blackwell Server Edition datasheet: 96 GB GDDR7 at 1.6-1.8 TB/s,
    # ~120 TFLOP/s FP32, "4 PFLOPS FP4" (sparse); BF16 dense with FP32 accumulate is not on the
    # datasheet: 250 TFLOP/s is an estimate (unverified). No NVLink: peers over PCIe Gen5 x16.
    "rtx-pro-6000": Hardware(
        "rtx-pro-6000", 250e12, 96 * GB, 1.8e12, 25 * GB, 10e-6, 12 * GB, 15e-6, 8,
        "Blackwell workstation/server card, no NVLink: peer traffic over PCIe Gen5 x16 "
        "(~50 GB/s per direction nominal, ~25 GB/s ring bus bandwidth), 100 Gb/s between nodes; "
        "the BF16 peak is an estimate", peak_fp32=120e12, **HOPPER),
}


def steps(op: str, n: int) -> int:
    """Latency steps of the ring algorithm."""
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in ("all_gather", "reduce_scatter", "all_to_all", "broadcast", "scatter", "gather",
              "reduce"):
        return n - 1
    return 1


def collective_seconds(op: str, size: float, n: int, bw: float, latency: float) -> float:
    """Alpha-beta time of one collective."""
    if n <= 1:
        return 0.0
    return steps(op, n) * latency + bytes_sent(op, size, n) / bw


def get(name: str, bench_json: str | None = None) -> Hardware:
    if name == "this-machine":
        return this_machine(bench_json)
    if name not in PRESETS:
        from ..config import ConfigError, did_you_mean

        names = list(PRESETS) + ["this-machine"]
        raise ConfigError([f"--gpu {name}: no such GPU{did_you_mean(name, names)} "
                           f"(choose one of {', '.join(names)})"])
    return PRESETS[name]


# ------------------------------------------------------------------------ this machine
def measure_matmul_flops(n: int = 512, seconds: float = 0.2) -> float:
    """FLOP/s of an n×n fp32 matmul (numpy) on this process."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    b = a.copy()
    a @ b
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2.0 * n**3 * reps / (time.perf_counter() - t0)


def fit_alpha_beta(rows: list[tuple[str, float, int, float]]) -> tuple[float, float]:
    """Least-squares fit of t = steps·α + bytes_sent/β to (op, size, n, seconds) rows."""
    import numpy as np

    a = np.array([[steps(op, n), bytes_sent(op, s, n)] for op, s, n, _ in rows], dtype=float)
    t = np.array([r[3] for r in rows], dtype=float)
    coef, *_ = np.linalg.lstsq(a, t, rcond=None)
    alpha = max(float(coef[0]), 1e-7)
    inv_beta = max(float(coef[1]), 1e-13)
    return alpha, 1.0 / inv_beta


def _rows_from_bench(data) -> list[tuple[str, float, int, float]]:
    """Accept a list of rows or {"rows"|"results": [...], "world": n} with size/size_bytes,
    n/world, and seconds/time_us fields (``fived bench comm --json``; rows of impl "backend")."""
    world = 2
    if isinstance(data, dict):
        world = int(data.get("world", 2))
        data = data.get("rows") or data.get("results") or data.get("data") or []
    rows = []
    for r in data:
        if not isinstance(r, dict) or r.get("impl", "backend") != "backend":
            continue
        size = r.get("size", r.get("size_bytes", r.get("bytes")))
        n = r.get("n", r.get("nprocs", r.get("world", r.get("ranks", world))))
        sec = r.get("seconds", r.get("time"))
        if sec is None and "time_us" in r:
            sec = r["time_us"] * 1e-6
        op = r.get("op", r.get("collective", "all_reduce"))
        if size is None or sec is None or op not in ("all_reduce", "all_gather", "reduce_scatter",
                                                     "all_to_all", "send", "broadcast"):
            continue
        rows.append((op, float(size), int(n), float(sec)))
    return rows


def this_machine(bench_json: str | None = None, gpus_per_node: int | None = None) -> Hardware:
    """A preset for the machine we run on: a measured matmul for the peak, and the link fitted
    from ``fived bench comm --json`` output when given (else gloo-like 1 GB/s, 50 µs)."""
    peak = measure_matmul_flops()
    mem = 16 * GB
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    mem = float(line.split()[1]) * 1024
    except OSError:
        pass
    alpha, beta = 50e-6, 1 * GB
    note = "link: default gloo-like guess (give --bench-json from `fived bench comm --json`)"
    if bench_json:
        with open(bench_json) as f:
            data = json.load(f)
        if isinstance(data, dict) and data.get("schema") == "fived.bench":  # the sweep's rows
            data = {**data["extra"], "rows": [r["extra"] for r in data["rows"]]}
        fit = data.get("fit") if isinstance(data, dict) else None
        fits = data.get("fits") if isinstance(data, dict) else None
        if isinstance(fit, dict) and "alpha" in fit and "beta" in fit:
            alpha, beta = float(fit["alpha"]), float(fit["beta"])
        elif isinstance(fits, dict) and fits.get("all_reduce", {}).get("beta_GBps"):
            # the bench fits t = alpha + bus_bytes/beta per collective; the ledger's alpha is
            # per ring step, so divide by the all-reduce's 2(n−1) steps
            f = fits["all_reduce"]
            world = int(data.get("world", 2))
            alpha = float(f["alpha_us"]) * 1e-6 / max(1, steps("all_reduce", world))
            beta = float(f["beta_GBps"]) * 1e9
        else:
            rows = _rows_from_bench(data)
            if len(rows) >= 2:
                alpha, beta = fit_alpha_beta(rows)
        note = f"link fitted from {bench_json}"
    cores = os.cpu_count() or 1
    hw = Hardware("this-machine", peak, mem, 20 * GB, beta, alpha, beta, alpha,
                  gpus_per_node or cores, note + f"; peak = measured fp32 matmul, {cores} cores")
    return replace(hw)
