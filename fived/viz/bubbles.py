"""Part 7, bubbles: the Gantt chart of every schedule and the measured bubble against the formula.

* ``bubbles-gantt``     the executor's own action lists (``fived.schedules``)
  simulated with unit costs, one panel per schedule (the picture ``fived figures schedule`` draws);
* ``bubbles-measured``  for each schedule and a growing number of micro-batches m, the bubble a
  real pipeline run measured on spawned gloo ranks (``PipelineExecutor`` stats: 1 − compute /
  makespan, mean over ranks, median over the steps after the first) next to the formula
  (``schedules.bubble_formula``: (p−1)/(m+p−1), (p−1)/(v·m+p−1), (p−1)/(3m+p−1), and
  1 − 6m/max(6m+p−1, 4m+4p−2) for ZB-V and DualPipe-V).

Each F/B/W action sleeps a fixed time on top of its (tiny) real work, as the pipeline tests do, so
the stage cost is uniform and the machine's load does not drown the schedule's geometry.
``fived figures bubbles --out DIR [--quick]`` (quick: p=2, m ∈ {2, 4}; full: p=4, m ∈ {4, 8, 16}).
"""

from __future__ import annotations

import statistics
from typing import Any

from .. import schedules as pipeline_schedules
from ..config import ModelConfig, ParallelConfig, TrainConfig
from ._fig import COLORS, Figure, part_main


def setup(quick: bool) -> dict[str, Any]:
    if quick:
        return {"pp": 2, "ms": [2, 4], "unit": 0.02, "steps": 2}
    return {"pp": 4, "ms": [4, 8, 16], "unit": 0.03, "steps": 3}  # interleaved: m % pp == 0


def ms_for(name: str, c: dict[str, Any]) -> list[int]:
    """The micro-batch counts a schedule runs at (DualPipe-V needs m ≥ 2p)."""
    return [m for m in c["ms"] if name != "dualpipe-v" or m >= 2 * c["pp"]]


def par_for(name: str, pp: int, m: int) -> ParallelConfig:
    return ParallelConfig(pp=pp, micro_batches=m, schedule=name,
                          virtual_stages=2 if name in ("interleaved",) + pipeline_schedules.V_SHAPED else 1)


def delay_for(name: str, unit: float) -> dict[str, float]:
    # the formula's costs: B = 2F (one unit of W and one of B for the split schedules ZB-H1,
    # ZB-V, DualPipe-V: F = B = W)
    split = name in ("zb-h1",) + pipeline_schedules.V_SHAPED
    return {"F": unit, "B": unit, "W": unit} if split else {"F": unit, "B": 2 * unit}


def timed_rank(rank: int, world: int, model: ModelConfig, jobs: list[tuple], train: TrainConfig
               ) -> list[list[dict[str, Any]]]:
    """On one pp rank: for each (layout, delay, steps) the executor's stats of every step."""
    import torch

    from ..train.trainer import Trainer

    out = []
    for par, delay, steps in jobs:
        torch.manual_seed(train.seed)
        t = Trainer(model, par, train, rank, world)
        t.executor.delay = delay
        stats = []
        for step in range(steps):
            x, y, pos = t.local_data(step)
            t.engine.zero_grad()
            t.forward_backward(x, y, pos, 1.0 / (train.global_batch * model.seq_len))
            stats.append({k: v for k, v in t.executor.stats.items() if k != "peak_live"})
        out.append(stats)
    return out


def measured(per_rank: list[list[dict[str, Any]]]) -> float:
    """Median over steps 1.. of the mean over ranks of the measured bubble."""
    steps = len(per_rank[0])
    per_step = [statistics.mean(r[k]["bubble"] for r in per_rank) for k in range(1, steps)]
    return statistics.median(per_step)


def measure(quick: bool, tick) -> dict[str, Any]:
    from ..testing import run_ranks

    c = setup(quick)
    model = ModelConfig(layers=2 * c["pp"], hidden=32, heads=2, kv_heads=1, ffn=64, seq_len=16)
    train = TrainConfig(global_batch=max(c["ms"]), seed=7, corpus_mb=1.0)
    jobs = [(par_for(n, c["pp"], m), delay_for(n, c["unit"]), c["steps"])
            for n in pipeline_schedules.NAMES for m in ms_for(n, c)]
    tick(f"bubbles: {len(jobs)} pipeline runs on {c['pp']} ranks")
    out = run_ranks(timed_rank, c["pp"], model, jobs, train, timeout=1200)
    rows: dict[str, Any] = {}
    for i, (par, delay, _) in enumerate(jobs):
        per_rank = [o[i] for o in out]
        v = par.virtual_stages
        sched = pipeline_schedules.build(par.schedule, par.pp, par.micro_batches, v)
        rows.setdefault(par.schedule, []).append({
            "m": par.micro_batches, "v": v, "delay_s": delay,
            "measured": measured(per_rank),
            "per_rank_steps": [[s["bubble"] for s in r] for r in per_rank],
            "formula": pipeline_schedules.bubble_formula(par.schedule, par.pp, par.micro_batches, v),
            "simulated": pipeline_schedules.simulate(sched).bubble_fraction()})
    return {"pp": c["pp"], "model": model.name, "steps": c["steps"], "schedules": rows}


def draw_measured(d: dict[str, Any], f: Any) -> None:
    ax = f.add_subplot(111)
    for i, (name, rows) in enumerate(d["schedules"].items()):
        ms = [r["m"] for r in rows]
        ax.plot(ms, [r["formula"] for r in rows], color=COLORS[i], ls="--", lw=0.9)
        ax.plot(ms, [r["measured"] for r in rows], color=COLORS[i], marker="o", label=name)
    ax.plot([], [], color="gray", ls="--", label="formula")
    ax.set(xscale="log", xlabel="micro-batches m", ylabel="bubble fraction",
           title=f"p = {d['pp']}: measured (dots) vs formula (dashed)")
    ax.set_xticks([r["m"] for r in next(iter(d["schedules"].values()))],
                  [str(r["m"]) for r in next(iter(d["schedules"].values()))])
    from matplotlib.ticker import NullLocator

    ax.xaxis.set_minor_locator(NullLocator())
    ax.legend(fontsize=7)


def gantt_data(pp: int, m: int) -> dict[str, Any]:
    out = {}
    for name in pipeline_schedules.NAMES:
        if name == "dualpipe-v" and m < 2 * pp:
            continue
        v = par_for(name, pp, m).virtual_stages
        sched = pipeline_schedules.build(name, pp, m, v)
        t = pipeline_schedules.simulate(sched)
        out[name] = {"v": v, "makespan": t.makespan, "bubble": t.bubble_fraction(),
                     "formula": pipeline_schedules.bubble_formula(name, pp, m, v),
                     "spans": [[[a.kind, a.mb, a.stage, s, e] for a, s, e in spans
                                if a.kind in ("F", "B", "W")] for spans in t.spans]}
    return {"pp": pp, "m": m, "schedules": out}


def draw_gantt(d: dict[str, Any], f: Any) -> None:
    from .schedule import draw_on

    axes = f.subplots(len(d["schedules"]), 1)
    for ax, (name, g) in zip(axes, d["schedules"].items()):
        sched = pipeline_schedules.build(name, d["pp"], d["m"], g["v"])
        draw_on(ax, sched, pipeline_schedules.simulate(sched))


def figures(quick: bool, tick) -> list[Figure]:
    pp, m = (2, 4) if quick else (4, 8)
    data = measure(quick, tick)
    return [
        Figure("bubbles-gantt", f"Pipeline schedules, p={pp}, m={m} (the executor's lists)",
               "bubbles", "schedule", "fived.schedules.build + simulate "
               "(unit F, B = 2F; F = B = W for ZB-H1)", gantt_data(pp, m), draw_gantt,
               size=(9.0, 2.0 * len(pipeline_schedules.NAMES))),
        Figure("bubbles-measured", "Measured pipeline bubble vs the formula", "bubbles",
               "run", f"PipelineExecutor stats on {data['pp']} spawned gloo ranks, sleep-"
               "dominated F/B/W; bubble = 1 − compute/makespan; formula "
               "schedules.bubble_formula", data, draw_measured),
    ]


main = part_main("bubbles", figures, __doc__)
