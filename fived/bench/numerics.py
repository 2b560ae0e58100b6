"""Part 8 and 9 experiments, each measured: ``fived bench numerics EXPERIMENT``.

    masters     bf16 parameters: fp32 master vs in place (round to nearest), stochastic
                rounding, Kahan compensation — loss per step and the fraction of the optimizer's
                parameter updates that round to zero in the stored bf16 value
    moments     AdamW's m and v stored in fp32, bf16, fp16 (fp32 parameters): per step the
                fraction of v that underflowed to 0 where g ≠ 0, of m and v updates lost (the
                stored value did not move although the update was not 0), and the loss
    reduce      summing dp gradient shards in bf16 vs fp32, in ring order (each hop rounds to
                the reduction dtype): relative error against the float64 sum as dp grows, on the
                real per-shard gradients of the model
    fp16        fp16 with dynamic loss scaling (from 2²⁴, growth every 5 clean steps): per step
                the scale, overflow (non-finite gradient elements), underflow (dense gradient
                elements flushed to 0 / left subnormal in fp16 at that scale) and the elements
                whose true value g/S is below fp16's smallest subnormal (would flush at S = 1)
    optimizers  bytes sent and step time of every --optimizer on dp2 ZeRO-2, dp2 ZeRO-3 with
                row-aligned shards, tp2 (2 ranks; the bytes are the ledger's to the byte)

Each writes ``OUT/numerics-EXPERIMENT.json`` (every measured number) and a PNG, and prints a
short table. One rank unless said; the model is ``tiny`` cut to ``--layers`` blocks (default 2)
so bf16/fp16 on a CPU stays quick.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..config import ParallelConfig, TrainConfig, preset
from ..ui.args import Parser

if TYPE_CHECKING:  # torch is imported where it runs: --help stays fast
    import torch

EXPERIMENTS = ("masters", "moments", "reduce", "fp16", "optimizers", "fp8")


def model_cfg(layers: int):
    return replace(preset("tiny"), layers=layers)


def train_cfg(steps: int, lr: float) -> TrainConfig:
    return TrainConfig(steps=steps, global_batch=8, lr=lr, warmup=2, seed=7, log_every=1)


def _trainer(m, par, t):
    from ..train.trainer import Trainer

    return Trainer(m, par, t, 0, 1)


def progress(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- masters
def masters(args, say=progress) -> dict[str, Any]:
    m, t = model_cfg(args.layers), train_cfg(args.steps, args.lr)
    out: dict[str, Any] = {}
    for mode in ("fp32", "none", "sr", "kahan"):
        tr = _trainer(m, ParallelConfig(precision="bf16", master_weights=mode), t)
        tr.engine.measure_rounding = True
        losses, lost = [], []
        for s in range(t.steps):
            losses.append(tr.step(s)["loss"])
            r = tr.engine.rounding
            lost.append(r["lost"] / max(1, r["moved"]))
        out[mode] = {"loss": losses, "lost_fraction": lost,
                     "master_bytes": int(tr.engine.memory()["master"])}
        say(f"  masters {mode:5s} final loss {losses[-1]:.4f}  updates lost "
                 f"{sum(lost) / len(lost):.3f}")
    return out


def masters_rows(res) -> list[list[str]]:
    ref = res["fp32"]["loss"]
    return [[k, f"{v['loss'][-1]:.4f}", f"{v['loss'][-1] - ref[-1]:+.4f}",
             f"{sum(v['lost_fraction']) / len(v['lost_fraction']):.3f}",
             str(v["master_bytes"])] for k, v in res.items()]


# ----------------------------------------------------------------------------- moments
class CountingAdamW:
    """AdamW with m and v stored in ``dtype`` (the update computed in fp32, then stored): the
    same update as ``fived.optim.FlatAdamW``, and per step the counts of what storage lost."""

    def __init__(self, opt, dtype: torch.dtype):
        self.o = opt
        self.dtype = dtype
        self.m = [x.to(dtype) for x in opt.m]
        self.v = [x.to(dtype) for x in opt.v]
        self.counts: dict[str, float] = {}

    def step(self, grads, lr):
        o = self.o
        o.t += 1
        b1, b2 = o.beta1, o.beta2
        c1, c2 = 1 - b1 ** o.t, 1 - b2 ** o.t
        n = vz = ml = vl = 0
        for p, g, m, v in zip(o.params, grads, self.m, self.v):
            g = g.float()
            m32 = m.float() * b1 + (1 - b1) * g
            v32 = v.float() * b2 + (1 - b2) * g * g
            m_new, v_new = m32.to(self.dtype), v32.to(self.dtype)
            nz = g != 0
            n += int(nz.sum())
            vz += int(((v_new == 0) & nz).sum())
            ml += int(((m_new == m) & (m32 != m.float()) & nz).sum())
            vl += int(((v_new == (v.float() * b2).to(self.dtype)) & nz & (v32 != v.float() * b2))
                      .sum())
            m.copy_(m_new)
            v.copy_(v_new)
            if o.wd:
                p.mul_(1 - lr * o.wd)
            p.addcdiv_(m.float(), (v.float() / c2).sqrt_().add_(o.eps), value=-lr / c1)
        self.counts = {"v_underflow": vz / max(1, n), "m_lost": ml / max(1, n),
                       "v_lost": vl / max(1, n)}


def moments(args, say=progress) -> dict[str, Any]:
    import torch
    m, t = model_cfg(args.layers), train_cfg(args.steps, args.lr)
    out: dict[str, Any] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                        ("fp16", torch.float16)):
        tr = _trainer(m, ParallelConfig(), t)
        opt = CountingAdamW(tr.engine.opt, dtype)
        tr.engine.opt = opt
        rec: dict[str, list[float]] = {"loss": [], "v_underflow": [], "m_lost": [], "v_lost": []}
        for s in range(t.steps):
            rec["loss"].append(tr.step(s)["loss"])
            for k, v in opt.counts.items():
                rec[k].append(v)
        out[name] = rec
        say(f"  moments {name}: final loss {rec['loss'][-1]:.4f}  v underflow "
                 f"{max(rec['v_underflow']):.4f}  m lost {max(rec['m_lost']):.4f}  v lost "
                 f"{max(rec['v_lost']):.4f}")
    return out


def moments_rows(res) -> list[list[str]]:
    ref = res["fp32"]["loss"][-1]
    return [[k, f"{v['loss'][-1]:.4f}", f"{v['loss'][-1] - ref:+.4f}",
             f"{max(v['v_underflow']):.4f}", f"{max(v['m_lost']):.4f}",
             f"{max(v['v_lost']):.4f}"] for k, v in res.items()]


# ----------------------------------------------------------------------------- reduce
def shard_grads(m, t, shards: int) -> list[torch.Tensor]:
    """The model's flat fp32 gradient of each of ``shards`` equal parts of one global batch
    (each part's Σ CE / global tokens, as every dp rank computes it)."""
    import torch

    from ..model.llama import build_model
    from ..train.data import global_batch

    model = build_model(m, t.seed)
    x, y = global_batch(0, t.seed, t.global_batch, m.seq_len, t.corpus_mb)
    positions = torch.arange(m.seq_len)
    n = x.shape[0] // shards
    out = []
    for i in range(shards):
        model.zero_grad()
        loss = model(x[i * n:(i + 1) * n], positions, y[i * n:(i + 1) * n])
        (loss / (x.shape[0] * m.seq_len)).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
    return out


def ring_sum(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Σ parts in ring order, rounding to ``dtype`` after each hop (reduce-scatter's chunks each
    start at a different rank; the rounding per hop is the same)."""
    acc = parts[0].to(dtype)
    for p in parts[1:]:
        acc = (acc.float() + p.to(dtype).float()).to(dtype)
    return acc.double()


def reduce(args, say=progress) -> dict[str, Any]:
    import torch
    m, t = model_cfg(args.layers), replace(train_cfg(1, args.lr), global_batch=16)
    out: dict[str, Any] = {"dp": [], "bf16": [], "fp32": [], "bf16_input_only": []}
    for dp in (1, 2, 4, 8, 16):
        parts = shard_grads(m, t, dp)
        exact = torch.stack([p.double() for p in parts]).sum(0)
        norm = float(exact.norm())
        out["dp"].append(dp)
        for key, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            out[key].append(float((ring_sum(parts, dt) - exact).norm()) / norm)
        # the rounding of the inputs alone (each shard sent in bf16, summed exactly)
        inp = torch.stack([p.to(torch.bfloat16).double() for p in parts]).sum(0)
        out["bf16_input_only"].append(float((inp - exact).norm()) / norm)
        say(f"  reduce dp={dp:2d}: bf16 {out['bf16'][-1]:.2e}  fp32 {out['fp32'][-1]:.2e}")
    return out


def reduce_rows(res) -> list[list[str]]:
    return [[str(d), f"{b:.2e}", f"{i:.2e}", f"{f:.2e}"]
            for d, b, i, f in zip(res["dp"], res["bf16"], res["bf16_input_only"], res["fp32"])]


# ----------------------------------------------------------------------------- fp16
def fp16(args, say=progress) -> dict[str, Any]:
    import torch
    m, t = model_cfg(args.layers), train_cfg(args.steps, args.lr)
    tr = _trainer(m, ParallelConfig(precision="fp16", grad_reduce_dtype="bf16"), t)
    sc = tr.engine.scaler
    sc.scale, sc.growth_interval = 2.0 ** 24, 5  # start too high, grow fast: both directions
    rec: dict[str, list[float]] = {"scale": [], "overflow": [], "underflow": [], "subnormal": [],
                                   "flush_at_scale_1": [], "skipped": [], "loss": []}

    def count():
        """Non-finite gradient elements (overflow), and among the dense parameters' elements
        (not the embedding, whose rows of bytes absent from the batch are exactly 0) those
        flushed to 0 and those left subnormal (< 2⁻¹⁴) in the fp16 gradient."""
        n = zeros = sub = over = flush1 = 0
        for b in tr.engine.buckets:
            for j, name in enumerate(b.names):
                g = b.view(b.grad_shard, j)
                over += int((~torch.isfinite(g)).sum())
                if name.startswith("embed_tokens"):
                    continue
                n += g.numel()
                zeros += int((g == 0).sum())
                sub += int(((g != 0) & (g.abs() < 2.0 ** -14)).sum())
                true = g.float().abs() / sc.scale  # the gradient the scale multiplied
                flush1 += int(((true > 0) & (true < 2.0 ** -25)).sum())
        rec["overflow"].append(over)
        rec["flush_at_scale_1"].append(flush1 / n)
        rec["underflow"].append(zeros / n)  # flushed to 0 at this step's scale
        rec["subnormal"].append(sub / n)

    for s in range(t.steps):
        rec["scale"].append(sc.scale)
        r = tr.step(s, count)
        rec["skipped"].append(bool(r["skipped"]))
        rec["loss"].append(r["loss"])
    say(f"  fp16: {sum(rec['skipped'])} skipped steps, final scale {sc.scale:g}")
    return rec


def fp16_rows(res) -> list[list[str]]:
    return [[str(i), f"{s:g}", str(o), f"{u:.5f}", f"{sn:.4f}", f"{f1:.4f}",
             "yes" if k else ""]
            for i, (s, o, u, sn, f1, k) in enumerate(zip(
                res["scale"], res["overflow"], res["underflow"], res["subnormal"],
                res["flush_at_scale_1"], res["skipped"]))]


# ----------------------------------------------------------------------------- optimizers
LAYOUTS = {"dp2 zero2": ParallelConfig(dp=2, zero=2),
           "dp2 zero3 rows": ParallelConfig(dp=2, zero=3, zero_align="rows"),
           "tp2": ParallelConfig(tp=2)}


def _opt_rank(rank: int, world: int, runs: list[tuple]) -> list[dict]:
    from ..train.trainer import Trainer

    out = []
    for m, p, t in runs:
        tr = Trainer(m, p, t, rank, world)
        secs, traffic = [], {}
        for s in range(t.steps):
            secs.append(tr.step(s)["seconds"])
            traffic = {k: v for k, v in tr.traffic.bytes_by_dim().items() if k != "metrics"}
        out.append({"seconds": sorted(secs[1:])[len(secs[1:]) // 2], "traffic": traffic,
                    "state": int(tr.engine.memory()["optimizer"])})
    return out


def optimizers(args, say=progress) -> dict[str, Any]:
    from ..config import OPTIMIZERS
    from ..ledger.traffic import step_bytes
    from ..ranks.launch import run_local

    m, layouts = model_cfg(args.layers), LAYOUTS
    runs = [(m, p, replace(train_cfg(max(3, args.steps // 4), args.lr), optimizer=o))
            for p in layouts.values() for o in OPTIMIZERS]
    say(f"  optimizers: {len(runs)} runs of {runs[0][2].steps} steps on 2 local ranks")
    res = run_local(_opt_rank, 2, (runs,), timeout=1800, collective_timeout=600)[0]
    out: dict[str, Any] = {}
    for (mm, p, t), r, name in zip(runs, res, [n for n in layouts for _ in OPTIMIZERS]):
        base = step_bytes(mm, p, t.global_batch // (p.dp * p.ep), 0, "adamw")
        extra = sum(r["traffic"].values()) - sum(base.values())
        out.setdefault(name, {})[t.optimizer] = {
            "seconds": r["seconds"], "bytes": sum(r["traffic"].values()), "extra_bytes": extra,
            "ledger_bytes": sum(step_bytes(mm, p, t.global_batch // (p.dp * p.ep), 0,
                                           t.optimizer).values()),
            "state_bytes": r["state"]}
    return out


def optimizers_rows(res) -> list[list[str]]:
    return [[lay, o, f"{v['state_bytes']:,}", f"{v['extra_bytes']:,.0f}",
             "yes" if v["bytes"] == v["ledger_bytes"] else "NO", f"{v['seconds'] * 1e3:.0f}"]
            for lay, d in res.items() for o, v in d.items()]


# ----------------------------------------------------------------------------- fp8
FP8_RUNS = ("none", "tensorwise", "rowwise", "blockwise")  # "none": the bf16 baseline
OUTLIERS = (1.0, 1e2, 1e3, 1e4, 1e5, 1e6)
SMALLEST_NORMAL: dict[Any, float] = {}  # filled with the formats at first use (torch is lazy)


def fp8_model(args):
    return replace(preset(args.model), layers=args.layers) if args.layers else preset(args.model)


def cast_stats(x: torch.Tensor, recipe: str, role: str) -> dict[str, float]:
    """amax of ``x`` and the fractions of its non-zero values the ``recipe``'s cast as operand
    ``role`` flushes to zero, saturates (|x / s| > fmax before the clamp) and leaves
    subnormal."""
    import torch

    from ..model import fp8 as fp8_mod

    fmt, tile = fp8_mod.role(recipe, role)
    if not SMALLEST_NORMAL:
        SMALLEST_NORMAL.update({f: float(torch.finfo(f).smallest_normal) for f in fp8_mod.FMAX})
    x2 = x.detach().reshape(-1, x.shape[-1]).float()
    if role == "w_fwd":
        x2 = x2.t()
    q = fp8_mod.quantize(x2, fmt, tile, pow2=True)
    s = fp8_mod.expand(q.scale, q.tile, tuple(x2.shape))
    nz = x2 != 0
    n = max(1, int(nz.sum()))
    v = (x2 / s).abs()
    return {"amax": float(x2.abs().max()),
            "flushed": int((nz & (q.data.float() == 0)).sum()) / n,
            # beyond fmax by more than the division's rounding (0 under current scaling:
            # the scale comes from this tensor's own amax)
            "saturated": int((nz & (v > fp8_mod.FMAX[fmt] * (1 + 2**-20))).sum()) / n,
            # below the format's smallest normal: kept with fewer significant bits
            "subnormal": int((nz & (v < SMALLEST_NORMAL[fmt])).sum()) / n}


def _watch(model, recipe: str) -> tuple[dict[str, dict[str, Any]], list[Any]]:
    """Hooks on every ``Fp8Linear`` of the one-rank ``model`` that take ``cast_stats`` of its
    input and weight (forward) and of its output gradient (backward) during the next step
    (the last micro-batch's); remove the returned hooks after it."""
    from ..model.fp8 import Fp8Linear

    seen: dict[str, dict[str, Any]] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, Fp8Linear):
            def fwd(m, inp, out, name=name):
                seen.setdefault(name, {}).update(x=cast_stats(inp[0], recipe, "x_fwd"),
                                                 w=cast_stats(m.weight, recipe, "w_fwd"))

            def bwd(m, gin, gout, name=name):
                seen.setdefault(name, {})["g"] = cast_stats(gout[0], recipe, "g_dgrad")
            hooks += [mod.register_forward_hook(fwd), mod.register_full_backward_hook(bwd)]
    return seen, hooks


def outlier_errors(seed: int = 0, tokens: int = 256, k: int = 512, n: int = 256
                   ) -> dict[str, Any]:
    """Why blockwise exists: x (tokens × k, N(0, 1)) with one channel (column 3) multiplied by
    each of ``OUTLIERS`` and W's column 3 zero (the outlier sets scales, adds nothing); per
    recipe the relative error of the fp8 product x·Wᵀ against float64 — what the other
    channels lost — and the fraction of x's values its cast flushes to zero. One channel sets
    the scale of every row (rowwise) or of the whole tensor (tensorwise), but of one 1×128
    tile per row only (blockwise)."""
    import torch

    from ..model import fp8 as fp8_mod

    g = torch.Generator().manual_seed(seed)
    base = torch.randn(tokens, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.02
    w[:, 3] = 0  # the outlier sets the scales but adds nothing: the error is the others'
    out: dict[str, Any] = {"outlier": list(OUTLIERS)}
    for recipe in fp8_mod.RECIPES:
        errs, flushed = [], []
        for mag in OUTLIERS:
            x = base.clone()
            x[:, 3] *= mag
            ref = x.double() @ w.double().t()
            y = fp8_mod.fp8_linear(x, w, recipe).double()
            errs.append(float((y - ref).norm() / ref.norm()))
            flushed.append(cast_stats(x, recipe, "x_fwd")["flushed"])
        out[recipe] = {"error": errs, "flushed": flushed}
    return out


def stats_steps(steps: int, every: int) -> list[int]:
    """The steps whose per-layer cast statistics ``fp8`` takes: the first, every ``every``-th
    (0: none between) and the last."""
    picked = set(range(0, steps, every)) if every > 0 else {0}
    return sorted(picked | {0, steps - 1} if steps else set())


def fp8(args, say=progress) -> dict[str, Any]:
    """bf16 and each fp8 recipe from one seed: loss and seconds per step, per-layer cast
    statistics at ``stats_steps`` (the first, every ``--stats-every``-th, the last), and the
    outlier experiment. A step that takes statistics casts every watched tensor once more
    (hooks; its seconds include them): ``watched`` lists those steps, and the median step time
    of the table leaves them out."""
    import torch

    m = fp8_model(args)
    if args.data:
        from ..data.meta import model_for_data

        m = model_for_data(m, args.data)
    t = replace(train_cfg(args.steps, args.lr), data=args.data or "")
    watched = stats_steps(t.steps, getattr(args, "stats_every", 0))
    out: dict[str, Any] = {"model": m.name, "layers": m.layers, "data": args.data or "built-in",
                           "global_batch": t.global_batch, "seq_len": m.seq_len, "seed": t.seed,
                           "stats_steps": watched, "runs": {}}
    torch.manual_seed(0)
    for recipe in FP8_RUNS:
        tr = _trainer(m, ParallelConfig(precision="bf16", fp8=recipe), t)
        losses, secs, stats = [], [], {}
        for s in range(t.steps):
            watch = recipe != "none" and s in watched
            seen, hooks = _watch(tr.stage, recipe) if watch else ({}, [])
            t0 = time.perf_counter()
            losses.append(tr.step(s)["loss"])
            secs.append(time.perf_counter() - t0)
            for h in hooks:
                h.remove()
            if watch:
                stats[str(s)] = seen
            if s % max(1, t.steps // 10) == 0:
                say(f"  fp8 {recipe:10s} step {s:4d} loss {losses[-1]:.4f}")
        tr.close()
        out["runs"][recipe] = {"loss": losses, "seconds": secs, "stats": stats}
        say(f"  fp8 {recipe:10s} final loss {losses[-1]:.4f}  median step "
            f"{median_step(secs, watched if recipe != 'none' else []):.2f} s")
    out["outliers"] = outlier_errors()
    return out


def median_step(secs: list[float], watched: list[int]) -> float:
    """The median seconds of the steps that took no statistics (all of them if every one
    did)."""
    skip = set(watched)
    xs = sorted(x for i, x in enumerate(secs) if i not in skip) or sorted(secs)
    return xs[len(xs) // 2]


def _tail_mean(xs: list[float], n: int = 10) -> float:
    tail = xs[-min(n, len(xs)):]
    return sum(tail) / len(tail)


def fp8_rows(res) -> list[list[str]]:
    ref = res["runs"]["none"]
    watched = res.get("stats_steps", [0, len(ref["loss"]) - 1])
    rows = []
    for k, v in res["runs"].items():
        st = v["stats"].get(str(len(v["loss"]) - 1), {})
        flushed = max((d[w]["flushed"] for d in st.values() for w in ("x", "w", "g")),
                      default=0.0)
        sat = max((d[w]["saturated"] for d in st.values() for w in ("x", "w", "g")),
                  default=0.0)
        rows.append(["bf16" if k == "none" else k, f"{v['loss'][-1]:.4f}",
                     f"{_tail_mean(v['loss']) - _tail_mean(ref['loss']):+.4f}",
                     f"{flushed:.2e}", f"{sat:.1e}",
                     f"{median_step(v['seconds'], [] if k == 'none' else watched):.2f}"])
    return rows


# ----------------------------------------------------------------------------- figures
def figure(name: str, res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(12, 3.2) if name == "fp8" else (9, 3.2))
    draw(name, res, fig)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)


def draw(name: str, res: dict, fig) -> None:
    """Experiment ``name``'s two panels into the matplotlib figure ``fig`` (also drawn by
    ``fived figures numerics|optimizers``)."""
    axes = fig.subplots(1, 3 if name == "fp8" else 2)
    a, b = axes[:2]
    if name == "masters":
        for k, v in res.items():
            a.plot([x - y for x, y in zip(v["loss"], res["fp32"]["loss"])], label=k)
            b.plot(v["lost_fraction"], label=k)
        a.set_title("loss − fp32-master loss")
        b.set_title("updates lost to bf16 rounding")
    elif name == "moments":
        for k, v in res.items():
            a.plot([x - y for x, y in zip(v["loss"], res["fp32"]["loss"])], label=k)
            b.plot(v["v_lost"], label=f"{k} v lost")
            b.plot(v["m_lost"], "--", label=f"{k} m lost")
        a.set_yscale("symlog", linthresh=1e-4)
        a.set_title("loss − fp32-moments loss (symlog)")
        b.set_title("moment updates lost (fraction)")
    elif name == "reduce":
        for k in ("bf16", "bf16_input_only", "fp32"):
            a.loglog(res["dp"], [max(x, 1e-12) for x in res[k]], "o-", label=k)
        a.set_title("‖sum − fp64 sum‖ / ‖fp64 sum‖")
        a.set_xlabel("dp")
        b.axis("off")
    elif name == "fp16":
        a.semilogy(res["scale"], label="loss scale")
        a.set_title("loss scale (skipped steps marked)")
        for i, k in enumerate(res["skipped"]):
            if k:
                a.axvline(i, color="r", alpha=0.3)
        b.plot(res["underflow"], label="= 0 (underflow)")
        b.plot(res["subnormal"], label="subnormal")
        b.plot(res["flush_at_scale_1"], label="would flush at scale 1")
        b.set_title("fp16 gradient elements (fraction, no embedding)")
    elif name == "fp8":
        ref = res["runs"]["none"]["loss"]
        for k, v in res["runs"].items():
            if k != "none":
                a.plot([x - y for x, y in zip(v["loss"], ref)], label=k, lw=0.8)
        a.axhline(0, color="k", lw=0.5)
        a.set_title("loss − bf16 loss (same seed, batches)")
        o = res["outliers"]
        for k in ("tensorwise", "rowwise", "blockwise"):
            b.loglog(o["outlier"], o[k]["error"], "o-", label=k)
        b.set_xlabel("outlier channel × (1 of 512)")
        b.set_title("x·Wᵀ rel. error, one outlier channel")
        c = axes[2]  # the per-layer statistics, at the steps that took them
        for k, v in res["runs"].items():
            steps = sorted(int(s) for s in v["stats"])
            if not steps:
                continue
            for w, style in (("x", "o-"), ("g", "s--")):
                c.plot(steps, [max(d[w]["flushed"] for d in v["stats"][str(s)].values())
                               for s in steps], style, ms=3, lw=0.8, label=f"{k} {w}")
        c.set_title("fraction flushed to 0, worst layer")
    elif name == "optimizers":
        lays = list(res)
        opts = list(res[lays[0]])
        w = 0.8 / len(opts)
        for j, o in enumerate(opts):
            xs = [i + j * w for i in range(len(lays))]
            a.bar(xs, [res[lay][o]["bytes"] / 1e6 for lay in lays], w, label=o)
            b.bar(xs, [res[lay][o]["seconds"] * 1e3 for lay in lays], w, label=o)
        for ax in (a, b):
            ax.set_xticks([i + 0.4 - w / 2 for i in range(len(lays))], lays)
            ax.set_xlabel("layout")
        a.set_title("MB sent per rank per step")
        b.set_title("step time (ms, median)")
    for ax in axes:
        if ax.has_data():
            ax.legend(fontsize=7)
            ax.set_xlabel(ax.get_xlabel() or "step")


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(n) for h, n in zip(headers, w))]
    lines += ["  ".join(c.rjust(n) for c, n in zip(r, w)) for r in rows]
    return "\n".join(lines)


HEADERS = {
    "masters": ["master", "final loss", "vs fp32", "lost/step", "master B"],
    "moments": ["m, v dtype", "final loss", "vs fp32", "v underflow", "m lost", "v lost"],
    "reduce": ["dp", "bf16 ring", "bf16 inputs", "fp32 ring"],
    "fp16": ["step", "scale", "overflow", "zero", "subnormal", "0 at S=1", "skipped"],
    "optimizers": ["layout", "optimizer", "state B", "extra sent B", "ledger", "step ms"],
    "fp8": ["recipe", "final loss", "gap (last 10)", "flushed", "saturated", "step s"],
}
RUN = {"masters": (masters, masters_rows), "moments": (moments, moments_rows),
       "reduce": (reduce, reduce_rows), "fp16": (fp16, fp16_rows),
       "optimizers": (optimizers, optimizers_rows), "fp8": (fp8, fp8_rows)}


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="fived bench numerics", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=EXPERIMENTS)
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    ap.add_argument("--layers", type=int, default=2, help="blocks of the model (default 2; fp8: "
                    "0 keeps the preset's)")
    ap.add_argument("--out", default=".", help="directory for the JSON and the PNG")
    ap.add_argument("--model", default="tiny", help="fp8: the model preset (default tiny; "
                    "docs/numerics.md ran small)")
    ap.add_argument("--data", default="", help="fp8: a prepared data directory (fived data "
                    "prepare; default the built-in corpus)")
    ap.add_argument("--stats-every", type=int, default=50, help="fp8: take the per-layer "
                    "amax / flushed / saturated statistics at the first step, every N-th and "
                    "the last (default 50; 0: first and last only)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.stats_every < 0:
        ap.error(f"--stats-every {args.stats_every}: a number of steps, 0 or more")
    progress(f"fived bench numerics {args.experiment}: "
             f"{args.model if args.experiment == 'fp8' else 'tiny'} with "
             f"{args.layers or 'all its'} blocks, {args.steps} steps")
    t0 = time.perf_counter()
    run, rows = RUN[args.experiment]
    res = run(args)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"numerics-{args.experiment}")
    with open(base + ".json", "w") as f:
        json.dump({"experiment": args.experiment, "args": vars(args), "result": res}, f)
    figure(args.experiment, res, base + ".png")
    print(text_table(HEADERS[args.experiment], rows(res)))
    print(f"wrote {base}.json and {base}.png ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
