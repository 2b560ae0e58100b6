"""Part 1, collectives: who sends what to whom, and how fast, measured on spawned gloo ranks.

* ``collectives-diagrams``  every primitive run once through ``fived.comm.ops`` on n ranks with
  tagged inputs (rank r's element c is 10·r + c): each rank's input and output as recorded by the
  run, and the bytes ``Traffic`` charged each rank (``fived.comm.volume.bytes_sent``);
* ``collectives-bandwidth`` ``fived bench comm``'s sweep (``fived.bench.comm.rank_main``) of every
  collective, backend and fived's ring: algbw and busbw against size, with the α-β fit's busbw
  curve (busbw(S) = bus_bytes(S) / (α + bus_bytes(S)/β));
* ``collectives-factor``    bytes ``Traffic`` charged per call over S, per collective, against the
  busbw factors 2(N−1)/N (all-reduce) and (N−1)/N (all-gather, reduce-scatter, ...).

``fived figures collectives --out DIR [--quick]`` (quick: 2 ranks, 1K..64K; full: 4 ranks,
1K..4M).
"""

from __future__ import annotations

from typing import Any

from ._fig import COLORS, Figure, part_main

DIAGRAM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce",
               "scatter", "gather")


def diagram_rank(rank: int, world: int) -> dict[str, Any]:
    """Run each primitive on tagged data; this rank's input, output and charged bytes."""
    import torch

    from ..comm import ops
    from ..comm.ops import Traffic
    from ..config import ParallelConfig
    from ..ranks.grid import Grid

    traffic = Traffic()
    g = Grid.from_config(ParallelConfig(dp=world), rank).connect(traffic)["dp"]
    n = world
    row = torch.tensor([10.0 * rank + c for c in range(n)])
    out: dict[str, Any] = {}
    for op in DIAGRAM_OPS:
        traffic.reset()
        x = row.clone()
        if op == "all_reduce":
            y = ops.all_reduce(x.clone(), g)
        elif op == "all_gather":
            x = torch.tensor([10.0 * rank])
            y = ops.all_gather(x, g)
        elif op == "reduce_scatter":
            y = ops.reduce_scatter(x, g)
        elif op == "all_to_all":
            y = ops.all_to_all(x, g)
        elif op == "broadcast":
            x = row.clone() if rank == 0 else torch.zeros(n)
            y = ops.broadcast(x.clone(), g, src=0)
        elif op == "reduce":
            y = ops.reduce(x.clone(), g, dst=0)
            if rank != 0:
                y = None  # only the root's result is defined
        elif op == "scatter":
            x = row.clone() if rank == 0 else torch.zeros(0)
            y = ops.scatter(list(row.chunk(n)) if rank == 0 else None, torch.zeros(1), g, src=0)
        else:  # gather
            x = torch.tensor([10.0 * rank])
            got = ops.gather(x, g, dst=0)
            y = torch.cat(got) if got is not None else None
        out[op] = {"input": x.tolist(), "output": None if y is None else y.tolist(),
                   "bytes": sum(r.bytes for r in traffic.records.values())}
    return out


def diagrams(n: int) -> dict[str, Any]:
    from ..testing import run_ranks

    per_rank = run_ranks(diagram_rank, n)
    return {"world": n, "tag": "rank r's element c is 10·r + c",
            "ops": {op: {"input": [r[op]["input"] for r in per_rank],
                         "output": [r[op]["output"] for r in per_rank],
                         "bytes": [r[op]["bytes"] for r in per_rank]} for op in DIAGRAM_OPS}}


def draw_diagrams(d: dict[str, Any], f: Any) -> None:
    axes = f.subplots(2, 4).ravel()
    n = d["world"]
    for ax, (op, o) in zip(axes, d["ops"].items()):
        ax.axis("off")
        ax.set_xlim(-0.6, 2 * n + 4.2)
        ax.set_ylim(-n - 0.5, 1)
        ax.set_title(op, fontsize=8)
        ax.text(n / 2, 0.4, "in", ha="center", fontsize=6)
        ax.text(n + 2 + n / 2, 0.4, "out", ha="center", fontsize=6)
        for r in range(n):
            ax.text(-0.1, -r, f"r{r}", ha="right", va="center", fontsize=6)
            for c, v in enumerate(o["input"][r]):
                ax.add_patch(_rect(c, -r - 0.4, COLORS[r % len(COLORS)]))
                ax.text(c + 0.45, -r, f"{v:g}", ha="center", va="center", fontsize=5)
            ax.annotate("", (n + 1.6, -r), (n + 0.2, -r),
                        arrowprops={"arrowstyle": "->", "lw": 0.5})
            for c, v in enumerate(o["output"][r] or []):
                ax.add_patch(_rect(n + 2 + c, -r - 0.4, "#dddddd"))
                ax.text(n + 2 + c + 0.45, -r, f"{v:g}", ha="center", va="center", fontsize=5)
            ax.text(2 * n + 2.2, -r, f"{o['bytes'][r]:g} B", va="center", fontsize=5)


def _rect(x: float, y: float, color: str):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), 0.9, 0.8, color=color, alpha=0.5)


def sweep(n: int, quick: bool) -> dict[str, Any]:
    from ..bench.comm import Settings, rank_main
    from ..comm.bench import BENCH_OPS, IMPLS, plan, size_sweep
    from ..ranks.launch import run_local

    sizes = size_sweep(1024, 64 * 1024 if quick else 4 * 1024 ** 2, 4.0)
    cfg = Settings(sizes, plan(list(BENCH_OPS), list(IMPLS)), "float32", 3 if quick else 10,
                   1 if quick else 3, json=True, progress=False, cpu=True)
    doc = run_local(rank_main, n, (cfg,), timeout=900, prefer_cpu=True)[0]
    doc["command"] = (f"fived bench comm --nprocs {n} -b 1K -e {sizes[-1] // 1024}K -f 4 "
                      f"--iters {cfg.iters} --warmup {cfg.warmup} --device cpu --json")
    return doc


def draw_bandwidth(d: dict[str, Any], f: Any) -> None:
    from ..comm.bench import Fit, bus_bytes

    ops_ = d["ops"]
    axes = f.subplots(2, (len(ops_) + 1) // 2).ravel()
    for ax, op in zip(axes, ops_):
        for j, impl in enumerate(d["impls"]):
            rows = [r for r in d["rows"] if r["op"] == op and r["impl"] == impl]
            if not rows:
                continue
            xs = [r["size_bytes"] for r in rows]
            ax.plot(xs, [r["busbw_GBps"] for r in rows], marker="o", ms=2, color=COLORS[j],
                    label=f"{impl} busbw")
            ax.plot(xs, [r["algbw_GBps"] for r in rows], ls=":", color=COLORS[j],
                    label=f"{impl} algbw")
            fit = d["fits_by_impl"].get(impl, {}).get(op)
            if fit:
                fit_ = Fit(**fit)
                bb = [bus_bytes(op, x, d["world"]) for x in xs]
                ax.plot(xs, [b / (fit_.predict_us(b) * 1e3) if b else 0 for b in bb], ls="--",
                        lw=0.7, color=COLORS[j + 2], label=f"{impl} α-β fit")
        ax.set(xscale="log", title=op)
        ax.tick_params(labelsize=6)
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=5)
    for ax in axes[len(ops_):]:
        ax.axis("off")


def factor_data(doc: dict[str, Any]) -> dict[str, Any]:
    from ..comm.bench import VOLUME_OP
    from ..comm.volume import busbw_factor

    n = doc["world"]
    out = {}
    for op in doc["ops"]:
        rows = [r for r in doc["rows"] if r["op"] == op and r["impl"] == "backend"]
        out[op] = {"sizes": [r["size_bytes"] for r in rows],
                   "recorded_over_S": [r["recorded_bytes"] / r["size_bytes"] for r in rows],
                   "factor": busbw_factor(VOLUME_OP[op], n)}
    return {"world": n, "ops": out}


def draw_factor(d: dict[str, Any], f: Any) -> None:
    ax = f.add_subplot(111)
    names = list(d["ops"])
    meas = [max(o["recorded_over_S"]) for o in d["ops"].values()]
    ax.bar(names, meas, color=COLORS[0], label="Traffic bytes / S (measured, max over sizes)")
    ax.scatter(names, [o["factor"] for o in d["ops"].values()], color="black", zorder=3,
               marker="_", s=300, label="busbw factor: 2(N−1)/N, (N−1)/N or 1")
    ax.set(ylabel="bytes per rank / S", title=f"N = {d['world']}")
    ax.tick_params(axis="x", labelsize=6, rotation=20)
    ax.legend(fontsize=8)


def figures(quick: bool, tick) -> list[Figure]:
    n = 2 if quick else 4
    tick(f"collectives: each primitive on {n} ranks")
    dia = diagrams(n)
    tick(f"collectives: bench comm sweep on {n} ranks")
    doc = sweep(n, quick)
    return [
        Figure("collectives-diagrams", f"Who sends what to whom ({n} ranks, measured)",
               "collectives", "run", "each primitive once through fived.comm.ops on spawned "
               "gloo ranks; inputs tagged 10·rank + index; bytes = this rank's Traffic",
               dia, draw_diagrams, size=(12.0, 4.4)),
        Figure("collectives-bandwidth", f"algbw and busbw vs size, {n} ranks, gloo",
               "collectives", "run", f"{doc['command']} (fived.bench.comm.rank_main); fit "
               "fived.comm.bench.fit_alpha_beta", doc, draw_bandwidth, size=(11.0, 5.0)),
        Figure("collectives-factor", "Bytes each rank sends per call over S, vs the busbw factor",
               "collectives", "run", "recorded_bytes of the sweep (fived.comm.ops Traffic, max "
               "over ranks) / S, against fived.comm.volume.busbw_factor", factor_data(doc),
               draw_factor),
    ]


main = part_main("collectives", figures, __doc__)
