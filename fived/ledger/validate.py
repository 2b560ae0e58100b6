"""The clock against published runs (``fived ledger --validate``).

``runs.toml`` (next to this file) lists public training runs, each with its source: the
model's shape, the layout, the global batch and the published throughput (TFLOP/s per GPU and
the MFU the source states, in the FLOP convention it states). For each run the planner's
``predict`` gives a step time; the predicted MFU *in the run's own convention* is

    MFU_pred = F_conv · tokens/s_pred / (gpus · peak)

and the throughput ratio is tokens/s_pred / tokens/s_pub with tokens/s_pub = published
TFLOP/s · gpus / F_conv. Where the source publishes tokens/s itself (torchtitan's WPS), the ratio
is taken from them and MFU_pred = MFU_pub · ratio, exact in any convention. The error is
MFU_pred − MFU_pub in points (percent of peak).

A family with ``fp8`` in its facts (Megatron-Bridge's H100 FP8-CS rows) runs its linear layers
in fp8 (``ParallelConfig.fp8``: the clock prices them at the device's fp8 peak); its MFU is on
the bf16 peak. Those rows are reported apart from the calibration's targets and never fitted.

``fit`` searches the few global constants of the clock (``hardware.FIT``: the GEMM curve's
ceiling and half-saturation dimension, flash attention's efficiency) on a small grid, the same
values for every run and preset, minimising the median absolute error then the worst.
"""

from __future__ import annotations

import itertools
import statistics
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from ..config import ConfigError, ModelConfig, ParallelConfig, validate
from . import compute, planner, roofline
from . import hardware as hardware_presets
from .memory import FUSED, ActivationOptions

RUNS = Path(__file__).with_name("runs.toml")


@dataclass
class Run:
    name: str
    family: str
    source: str
    gpu: str
    model: ModelConfig
    par: ParallelConfig
    gpus: int
    global_batch: int
    clock: roofline.ClockOptions
    flops: str  # the published FLOP convention
    tflops_per_gpu: float
    mfu: float
    memory_gb: float | None = None
    wps: float = 0.0  # published tokens per second per GPU, when the source gives them


def published_flops_per_token(m: ModelConfig, convention: str) -> float:
    if convention == "model":
        return compute.model_flops_per_token(m)
    if convention == "megatron-2021":  # 96·l·h²·(1 + s/6h + V/16lh) per sequence, per token
        h, ly, s, v = m.hidden, m.layers, m.seq_len, m.vocab
        return 96.0 * ly * h * h * (1 + s / (6 * h) + v / (16 * ly * h))
    raise ValueError(f"unknown FLOP convention {convention!r}")


def _virtual(rule, layers: int, pp: int) -> int:
    if isinstance(rule, int):
        return rule if pp > 1 else 1
    if pp == 1 or rule != "max-divisor-8":
        return 1
    per = layers // pp
    return max(v for v in range(1, 9) if per % v == 0)


def load(path: Path | str = RUNS) -> list[Run]:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    fams = data.get("family", {})
    out = []
    for row in data.get("run", []):
        fam = fams[row["family"]]
        kv = {**fam.get("assumed", {}), **fam.get("facts", {})}
        md = row["model"]
        h = md["hidden"]
        m = ModelConfig(name=row["name"], vocab=md.get("vocab", kv.get("vocab")), hidden=h,
                        layers=md["layers"],
                        heads=md["heads"], kv_heads=md.get("kv_heads", md["heads"]),
                        ffn=md.get("ffn", kv.get("ffn_mult", 4) * h),
                        seq_len=md.get("seq_len", kv.get("seq_len")),
                        # with pp > 1 Megatron keeps the tied embedding's copy on the last
                        # stage: the parameters of an untied model, as counted here (its
                        # embedding-group all-reduce, once per step, is left out)
                        tied_embeddings=kv.get("tied_embeddings", False)
                        and row["parallel"].get("pp", 1) == 1,
                        mlp=md.get("mlp", kv.get("mlp", "swiglu")),
                        positions=kv.get("positions", "rope"),
                        norm=kv.get("norm", "rmsnorm"), bias=kv.get("bias", False))
        pd = row["parallel"]
        tp, pp, dp = pd.get("tp", 1), pd.get("pp", 1), pd.get("dp", 1)
        per_replica = row["global_batch"] // dp
        b = kv.get("micro_batch", 1) or per_replica  # 0: the whole local batch at once
        v = pd["vp"] if "vp" in pd else _virtual(kv.get("virtual", ""), m.layers, pp)
        split: tuple[int, ...] = ()
        if pd.get("pp_layers_rule", kv.get("pp_layers_rule")) == "first-last-minus-one" and pp > 1:
            n = pp * v  # the first and the last (virtual) stage hold one layer less
            per = (m.layers + 2) // n
            split = (per - 1,) + (per,) * (n - 2) + (per - 1,)
        par = ParallelConfig(pp_layers=split,
            tp=tp, pp=pp, dp=dp, cp=pd.get("cp", 1), zero=pd.get("zero", kv.get("zero", 0)),
            schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v,
            micro_batches=per_replica // b, sequence_parallel=kv.get("sequence_parallel", False)
            and tp > 1, recompute=pd.get("recompute", kv.get("recompute", "none")),
            precision=kv["precision"], fp8=kv.get("fp8", "none"),
            grad_reduce_dtype=kv.get("grad_reduce_dtype", "fp32"), overlap=kv.get("overlap", True),
            bucket_mb=kv.get("bucket_mb", 25.0))
        pub = row["published"]
        clock = roofline.ClockOptions(attention=kv.get("attention", "flash"),
                               tp_overlap=kv.get("tp_overlap", False),
                               fused=kv.get("fused", True),
                               fused_gemm=kv.get("fused_gemm", False),
                               fused_loss=kv.get("fused_loss", True))
        out.append(Run(row["name"], row["family"], fam["source"], fam["gpu"], m, par,
                       row["gpus"], row["global_batch"], clock, kv.get("flops", "model"),
                       pub["tflops_per_gpu"], pub["mfu"], pub.get("memory_gb"),
                       pub.get("wps", 0.0)))
    return out


@dataclass
class Check:
    run: Run
    pred: planner.Prediction
    mfu_pred: float  # in the run's convention
    ratio: float  # predicted / published tokens per second

    @property
    def error_points(self) -> float:
        return 100.0 * (self.mfu_pred - self.run.mfu)


def check(run: Run, hw: hardware_presets.Hardware | None = None) -> Check:
    hw = hw or hardware_presets.PRESETS[run.gpu]
    validate(run.model, run.par, None, run.gpus)
    opts = ActivationOptions(run.clock.attention, FUSED.kv_repeat, FUSED.fused_norm)
    pred = planner.predict(run.model, run.par, hw, run.global_batch, opts=opts, clock=run.clock,
                      memory_fraction=1.0)
    f = published_flops_per_token(run.model, run.flops)
    peak = hw.matmul_peak(run.par.precision)
    mfu = f * pred.tokens_per_s / (run.gpus * peak)
    if run.wps:  # tokens/s published: the ratio is exact, whatever the FLOP convention
        ratio = pred.tokens_per_s / (run.wps * run.gpus)
        return Check(run, pred, run.mfu * ratio, ratio)
    pub_tps = run.tflops_per_gpu * 1e12 * run.gpus / f
    return Check(run, pred, mfu, pred.tokens_per_s / pub_tps)


def check_all(runs: list[Run] | None = None, consts: dict | None = None) -> list[Check]:
    runs = runs if runs is not None else load()
    out = []
    for r in runs:
        hw = hardware_presets.PRESETS[r.gpu]
        if consts:  # "name" for every preset, "name@gpu" for one
            hw = replace(hw, **{k.split("@")[0]: v for k, v in consts.items()
                                if "@" not in k or k.endswith("@" + r.gpu)})
        out.append(check(r, hw))
    return out


def summary(checks: list[Check]) -> dict:
    errs = [abs(c.error_points) for c in checks]
    worst = max(checks, key=lambda c: abs(c.error_points))
    return {"runs": len(checks), "median_abs_error_points": statistics.median(errs),
            "worst_abs_error_points": max(errs), "worst_run": worst.run.name,
            "mean_error_points": statistics.fmean(c.error_points for c in checks)}


GRID = {"gemm_eff@h100-sxm": (0.60, 0.65, 0.70, 0.75, 0.80),
        "gemm_eff@a100-80gb": (0.70, 0.75, 0.80, 0.85, 0.90),
        "gemm_d0": (64.0, 128.0, 256.0, 512.0, 1024.0),
        "attn_eff": (0.35, 0.45, 0.55)}


FITTED_ON = ("megatron-core-h100", "narayanan-2021-a100")  # the rest check out of sample


def fit(runs: list[Run] | None = None, grid: dict = GRID) -> tuple[dict, dict]:
    """The grid point minimising max(median |error| / 3, worst |error| / 8) over the runs
    (default: the families the presets were fitted on), then the median. fp8 rows are never
    fitted on: they check the clock's fp8 model out of sample."""
    runs = runs if runs is not None else [r for r in load() if r.family in FITTED_ON]
    runs = [r for r in runs if r.par.fp8 == "none"]
    best = None
    keys = list(grid)
    for vals in itertools.product(*(grid[k] for k in keys)):
        consts = dict(zip(keys, vals))
        try:
            s = summary(check_all(runs, consts))
        except ConfigError:
            continue
        # both targets at once: the median against 3 points, the worst against 8
        key = (max(s["median_abs_error_points"] / 3, s["worst_abs_error_points"] / 8),
               s["median_abs_error_points"])
        if best is None or key < best[0]:
            best = (key, consts, s)
    return best[1], best[2]
