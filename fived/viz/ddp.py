"""Part 2, DP → DDP: naive per-parameter all-reduce vs buckets vs buckets with overlap, measured.

Three variants of fived's data-parallel engine on the same model, ranks and batches:

* ``naive``            one all-reduce per parameter, all after the backward (``bucket_mb`` below
                       the smallest parameter, ``--no-overlap``);
* ``buckets``          flat buckets of ``bucket_mb``, all reduced after the backward;
* ``buckets+overlap``  the same buckets, each all-reduce started by the backward hook as soon as
                       its last gradient is ready (the DDP recipe, Li et al. 2020).

Figures: ``ddp-step`` the median step time of each (max over ranks, several steps, variants
alternating); ``ddp-timeline`` one measured step of each bucketed variant on rank 0 — the
backward's span and, per bucket, when its all-reduce was launched and when it was first seen
complete (polled at every gradient hook and at the final wait: an upper bound on the end);
``ddp-buckets`` the step time against ``bucket_mb`` with overlap.

``fived figures ddp --out DIR [--quick]``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

from ..config import ModelConfig, ParallelConfig, TrainConfig
from ._fig import COLORS, Figure, part_main

MODEL = ModelConfig(name="fig-ddp", vocab=256, hidden=128, layers=4, heads=4, kv_heads=2,
                    ffn=352, seq_len=64)
TRAIN = TrainConfig(global_batch=8, seed=5, corpus_mb=1.0)
TINY_MB = 1e-6  # below any parameter: one bucket per parameter


def variants(bucket_mb: float) -> dict[str, ParallelConfig]:
    base = ParallelConfig(dp=2)
    return {"naive": replace(base, bucket_mb=TINY_MB, overlap=False),
            "buckets": replace(base, bucket_mb=bucket_mb, overlap=False),
            "buckets+overlap": replace(base, bucket_mb=bucket_mb, overlap=True)}


class Probe:
    """Stamps each bucket's launch and first-seen completion, relative to ``t0``."""

    def __init__(self, engine: Any):
        self.engine, self.t0, self.events = engine, 0.0, {}
        start, wait = engine.start_reduce, engine.wait

        def start_reduce(b):
            h = start(b)
            self.events[b.index] = {"bucket": b.index, "bytes": b.grad.numel() * b.grad
                                    .element_size(), "launch": time.perf_counter() - self.t0,
                                    "done": None, "handle": h}
            return h

        def wait_(b):
            wait(b)
            self.poll(force=b.index)

        engine.start_reduce, engine.wait = start_reduce, wait_
        for bk in engine.buckets:
            for p in bk.params:
                p.register_post_accumulate_grad_hook(lambda _p: self.poll())

    def poll(self, force: int | None = None) -> None:
        now = time.perf_counter() - self.t0
        for i, e in self.events.items():
            if e["done"] is None:
                w = getattr(e["handle"], "work", None)
                if i == force or w is None or w.is_completed():
                    e["done"] = now

    def reset(self) -> None:
        self.events, self.t0 = {}, time.perf_counter()


def rank_fn(rank: int, world: int, bucket_mb: float, sweep: list[float], steps: int
            ) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from ..comm.ops import Traffic
    from ..model import build_model
    from ..parallel.parallelize import parallelize
    from ..ranks.grid import Grid
    from ..train import data

    pos = torch.arange(MODEL.seq_len)
    scale = 1.0 / (TRAIN.global_batch * MODEL.seq_len)

    def make(par):
        grid = Grid.from_config(par, rank).connect(Traffic())
        laid = parallelize(build_model(MODEL, TRAIN.seed), grid, par, TRAIN)
        return laid.model, laid.engine, Probe(laid.engine)

    def step(v, i, marks=None):
        model, engine, probe = v
        x, y = data.local_batch(i, TRAIN.seed, TRAIN.global_batch, MODEL.seq_len, rank, world,
                             TRAIN.corpus_mb)
        engine.zero_grad()
        engine.set_last_micro(True)
        loss = model(x, pos, y) * scale
        probe.reset()
        loss.backward()
        t_bwd = time.perf_counter() - probe.t0
        engine.finish()
        t_fin = time.perf_counter() - probe.t0
        engine.step(1e-3)
        if marks is not None:
            marks.update(backward_end=t_bwd, finish_end=t_fin,
                         buckets=[{k: v for k, v in e.items() if k != "handle"}
                                  for e in sorted(probe.events.values(),
                                                  key=lambda e: e["launch"])])

    def timed(vs: dict[str, Any]) -> dict[str, float]:
        times: dict[str, list[float]] = {k: [] for k in vs}
        for v in vs.values():
            step(v, 0)
        for rep in range(steps):
            for k in (list(vs) if rep % 2 == 0 else list(reversed(vs))):
                dist.barrier()
                t0 = time.perf_counter()
                step(vs[k], rep + 1)
                t = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[k].append(float(t))
        return {k: statistics.median(t) for k, t in times.items()}

    vs = {k: make(p) for k, p in variants(bucket_mb).items()}
    out: dict[str, Any] = {"step_s": timed(vs), "timeline": {}}
    out["buckets"] = {k: len(v[1].buckets) for k, v in vs.items()}
    for k in ("buckets", "buckets+overlap"):
        dist.barrier()
        marks: dict[str, Any] = {}
        step(vs[k], 99, marks)
        out["timeline"][k] = marks
    del vs
    sw = {str(mb): make(replace(ParallelConfig(dp=2), bucket_mb=mb)) for mb in sweep}
    out["sweep_s"] = timed(sw)
    out["sweep_buckets"] = {k: len(v[1].buckets) for k, v in sw.items()}
    return out


def measure(quick: bool, tick) -> dict[str, Any]:
    from ..testing import run_ranks

    bucket_mb = 0.5
    sweep = [0.1, 0.5, 4.0] if quick else [0.05, 0.1, 0.25, 0.5, 1.0, 4.0]
    steps = 2 if quick else 6
    tick("ddp: 3 variants + bucket sweep on 2 ranks")
    res = run_ranks(rank_fn, 2, bucket_mb, sweep, steps, timeout=900)
    return {"model": MODEL.name, "world": 2, "bucket_mb": bucket_mb, "steps": steps,
            "rank0": res[0], "rank1_step_s": res[1]["step_s"]}


def draw_step(d: dict[str, Any], f: Any) -> None:
    ax = f.add_subplot(111)
    s = d["rank0"]["step_s"]
    ax.bar(list(s), [v * 1e3 for v in s.values()], color=COLORS[:3])
    for i, k in enumerate(s):
        ax.text(i, s[k] * 1e3, f"{d['rank0']['buckets'][k]} bucket(s)", ha="center",
                va="bottom", fontsize=7)
    ax.set(ylabel="median step ms (max over ranks)", title=f"dp=2, bucket {d['bucket_mb']} MB")


def draw_timeline(d: dict[str, Any], f: Any) -> None:
    tl = d["rank0"]["timeline"]
    axes = f.subplots(len(tl), 1, sharex=True)
    for ax, (k, m) in zip(axes, tl.items()):
        ax.barh(-1, m["backward_end"] * 1e3, color="#bbbbbb", label="backward")
        for j, e in enumerate(m["buckets"]):
            ax.barh(j, (e["done"] - e["launch"]) * 1e3, left=e["launch"] * 1e3, color=COLORS[0])
        ax.axvline(m["finish_end"] * 1e3, color="black", ls="--", lw=0.8, label="finish()")
        ax.set(title=k, ylabel="bucket (launch order)")
        ax.legend(fontsize=8, loc="lower right")
    axes[-1].set_xlabel("ms since backward start (rank 0)")


def draw_sweep(d: dict[str, Any], f: Any) -> None:
    ax = f.add_subplot(111)
    s = d["rank0"]["sweep_s"]
    xs = [float(k) for k in s]
    ax.plot(xs, [v * 1e3 for v in s.values()], marker="o", color=COLORS[0])
    for x, k in zip(xs, s):
        ax.text(x, s[k] * 1e3, f" {d['rank0']['sweep_buckets'][k]}", fontsize=6)
    ax.set(xscale="log", xlabel="bucket_mb (with overlap; label: buckets)",
           ylabel="median step ms")


def figures(quick: bool, tick) -> list[Figure]:
    d = measure(quick, tick)
    how = ("fived's DDP engine on 2 spawned gloo ranks (parallelize + engine), variants "
           "alternating; step time = max over ranks, median over steps")
    return [
        Figure("ddp-step", "Naive DP vs buckets vs buckets + overlap: step time", "ddp", "run",
               how, d, draw_step),
        Figure("ddp-timeline", "Each bucket's all-reduce over the backward (measured)", "ddp",
               "run", how + "; launch and first-seen completion of each bucket's work", d,
               draw_timeline, size=(7.0, 5.0)),
        Figure("ddp-buckets", "Step time vs bucket size (overlap on)", "ddp", "run", how, d,
               draw_sweep),
    ]


main = part_main("ddp", figures, __doc__)
