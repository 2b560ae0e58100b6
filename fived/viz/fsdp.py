"""Part 4, FSDP1 vs FSDP2: fived ZeRO-3 against torch ``FullyShardedDataParallel`` (FSDP1) and
``fully_shard`` (FSDP2) on the same model, ranks and data — step time, model-state memory, and
fived's measured prefetch timeline.

* ``fsdp-step``      median step time (max over ranks) and model-state bytes per rank of each
  variant, from ``fived bench zero``'s runners (``fived.bench.harness.run_rank``: variants
  alternate inside every repetition);
* ``fsdp-prefetch``  one measured ZeRO-3 step on rank 0, with prefetch and with ``--no-overlap``:
  for every all-gather of a unit (forward and backward), when it was launched and when the unit's
  compute got it (``gather`` returned). With prefetch a unit's gather starts while the previous
  unit computes; without, it starts when needed and the bar is pure waiting. (torch's FSDP
  prefetch is not instrumented here.)

``fived figures fsdp --out DIR [--quick]``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from ._fig import COLORS, Figure, part_main


def bench_args(quick: bool):
    import argparse

    from ..bench.harness import common_args
    from ..ui import flags

    ap = argparse.ArgumentParser()
    common_args(ap)
    return flags.parse(ap, ["--layers", "2" if quick else "4", "--reps", "1" if quick else "5",
                          "--steps", "1" if quick else "3", "--warmup", "1"])


def build(cfg: Any, par: Any, train: Any, args: Any, rank: int, world: int, batch: Any) -> list:
    from ..bench.harness import fived_runner
    from ..bench.zero import fsdp1_runner, fsdp2_runner

    return [fived_runner("fived ZeRO-3", cfg, replace(par, zero=3), train, rank, world, batch),
            fsdp1_runner(cfg, train, world, batch),
            fsdp2_runner(cfg, train, world, batch)]


def prefetch_timeline(rank: int, world: int, args: Any) -> dict[str, Any]:
    import torch

    from ..bench.harness import bench_model
    from ..comm.ops import Traffic
    from ..config import ParallelConfig, TrainConfig
    from ..model import build_model
    from ..parallel.parallelize import parallelize
    from ..ranks.grid import Grid
    from ..train import data

    cfg = bench_model(args)
    train = TrainConfig(global_batch=args.global_batch, seed=1234, corpus_mb=1.0)
    pos = torch.arange(cfg.seq_len)
    out = {}
    for name, overlap in (("prefetch", True), ("no-overlap", False)):
        par = ParallelConfig(dp=world, zero=3, overlap=overlap)
        grid = Grid.from_config(par, rank).connect(Traffic())
        laid = parallelize(build_model(cfg, train.seed), grid, par, train)
        eng = laid.engine
        units = {id(u): i for i, u in enumerate(eng.units)} | {id(eng.root): -1}
        ev: list[dict[str, Any]] = []
        t0 = [0.0]
        pre, gat = eng.prefetch, eng.gather

        def prefetch(u, ahead=False, pre=pre, ev=ev, units=units, t0=t0):
            was = u.state
            pre(u, ahead)
            if was == "free" and u.state == "inflight":
                ev.append({"unit": units[id(u)], "launch": time.perf_counter() - t0[0],
                           "ahead": ahead, "ready": None})

        def gather(u, gat=gat, ev=ev, units=units, t0=t0):
            gat(u)
            for e in reversed(ev):
                if e["unit"] == units[id(u)]:
                    if e["ready"] is None:
                        e["ready"] = time.perf_counter() - t0[0]
                    break

        eng.prefetch, eng.gather = prefetch, gather
        for i in range(3):
            x, y = data.local_batch(i, train.seed, train.global_batch, cfg.seq_len, rank, world,
                                 train.corpus_mb)
            ev.clear()
            eng.zero_grad()
            eng.set_last_micro(True)
            t0[0] = time.perf_counter()
            loss = laid.model(x, pos, y) * (1.0 / (train.global_batch * cfg.seq_len))
            t_fwd = time.perf_counter() - t0[0]
            loss.backward()
            eng.finish()
            t_end = time.perf_counter() - t0[0]
            eng.step(1e-3)
        out[name] = {"events": [dict(e) for e in ev], "forward_end": t_fwd, "step_end": t_end,
                     "units": len(eng.units)}
    return out


def rank_fn(rank: int, world: int, args: Any) -> dict[str, Any]:
    from ..bench.harness import run_rank

    rows = run_rank(rank, world, build, args)
    return {"rows": rows, "timeline": prefetch_timeline(rank, world, args)}


def measure(quick: bool, tick) -> dict[str, Any]:
    from ..testing import run_ranks

    args = bench_args(quick)
    tick("fsdp: fived ZeRO-3 vs FSDP1 vs FSDP2 on 2 ranks")
    res = run_ranks(rank_fn, args.nprocs, args, timeout=900)
    return {"world": args.nprocs, "model": f"h{args.hidden}·l{args.layers}·s{args.seq_len}",
            "reps": args.reps, "steps": args.steps, "rows": res[0]["rows"],
            "timeline": res[0]["timeline"],
            "command": f"fived bench zero --nprocs {args.nprocs} --hidden {args.hidden} --layers "
                       f"{args.layers} --reps {args.reps} --steps {args.steps} --warmup 1"}


def draw_step(d: dict[str, Any], f: Any) -> None:
    a1, a2 = f.subplots(1, 2)
    names = [r["name"] for r in d["rows"]]
    a1.bar(names, [r["step_s"] * 1e3 for r in d["rows"]], color=COLORS[:len(names)])
    a1.set(ylabel="median step ms", title="step time")
    a2.bar(names, [r["state_bytes"] / 1e6 for r in d["rows"]], color=COLORS[:len(names)])
    a2.set(ylabel="model-state MB per rank", title="memory")
    for ax in (a1, a2):
        ax.tick_params(axis="x", labelsize=6, rotation=15)


def draw_prefetch(d: dict[str, Any], f: Any) -> None:
    tl = d["timeline"]
    axes = f.subplots(len(tl), 1, sharex=True)
    for ax, (k, m) in zip(axes, tl.items()):
        for j, e in enumerate(m["events"]):
            ready = e["ready"] if e["ready"] is not None else m["step_end"]
            ax.barh(j, (ready - e["launch"]) * 1e3, left=e["launch"] * 1e3,
                    color=COLORS[0] if e["ahead"] else COLORS[3])
            ax.text(ready * 1e3, j, f" u{e['unit']}", va="center", fontsize=5)
        ax.axvline(m["forward_end"] * 1e3, color="black", ls="--", lw=0.8)
        ax.set(title=f"{k} (blue: prefetched ahead, red: on demand; dashed: forward ends)",
               ylabel="gather #")
    axes[-1].set_xlabel("ms since the step's forward began (rank 0)")


def figures(quick: bool, tick) -> list[Figure]:
    d = measure(quick, tick)
    return [
        Figure("fsdp-step", "fived ZeRO-3 vs torch FSDP1 vs FSDP2", "fsdp", "run",
               f"{d['command']} runners (fived.bench.harness.run_rank), variants alternating",
               d, draw_step, size=(8.0, 3.6)),
        Figure("fsdp-prefetch", "ZeRO-3 all-gathers: prefetch vs on demand (measured)", "fsdp",
               "run", "one fived ZeRO-3 step on rank 0: each unit gather's launch and the time "
               "its compute received it", d, draw_prefetch, size=(7.0, 5.0)),
    ]


main = part_main("fsdp", figures, __doc__)
