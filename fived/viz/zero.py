"""Part 3, ZeRO: model-state memory per rank by stage 0–3 for several dp, measured beside the
ledger, and the bytes each stage sends.

Each (dp, stage) is a two-step ``fived train`` run on dp spawned gloo ranks (``_runs.train_many``);
the figure plots rank 0's ``engine.memory()`` (params + grads + master + optimizer, as held:
padded buffers and shards) and the ``dense`` group's bytes of the last step, next to
``fived.ledger.verify.predict_rank`` for the same rank — the comparison ``fived ledger --check``
makes, to the byte. Expected shape (Rajbhandari et al. 2020): stage 1 divides master + Adam by
N, stage 2 also the gradients, stage 3 also the parameters; stages 0–2 send 2(N−1)/N·Ψ·4 bytes,
stage 3 (3Ψ − Ψ_root)(N−1)/N·4 (two gathers of each block and one of the root, which stays
gathered from its forward to its backward, and a reduce-scatter).

``fived figures zero --out DIR [--quick]`` (quick: dp ∈ {1, 2}; full: dp ∈ {1, 2, 4}).
"""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig, ParallelConfig, TrainConfig
from ._fig import COLORS, Figure, part_main

MODEL = ModelConfig(name="fig-zero", hidden=64, layers=2, heads=4, kv_heads=2, ffn=176,
                    seq_len=32)
TRAIN = TrainConfig(steps=2, global_batch=4, seed=3, corpus_mb=1.0, warmup=1)
STATE_KEYS = ("params", "grads", "master", "optimizer")


def measure(quick: bool, tick) -> dict[str, Any]:
    from ..ledger.verify import predict_rank
    from ._runs import train_many

    dps = [1, 2] if quick else [1, 2, 4]
    runs = [(MODEL, ParallelConfig(dp=dp, zero=z, bucket_mb=0.05), TRAIN)
            for dp in dps for z in range(4)]
    tick(f"zero: {len(runs)} two-step runs, dp ∈ {dps}")
    res = train_many(runs)
    rows = []
    for (m, par, train), r in zip(runs, res):
        mem_l, traf_l = predict_rank(m, par, train.global_batch, 0)
        mem = r["memory_per_rank"][0]
        rows.append({"dp": par.dp, "zero": par.zero,
                     "measured": {k: mem[k] for k in STATE_KEYS},
                     "ledger": {k: mem_l[k] for k in STATE_KEYS},
                     "measured_bytes": r["traffic_per_rank"][0]["bytes"].get("dense", 0.0),
                     "ledger_bytes": traf_l.get("dense", 0.0),
                     "memory_per_rank": r["memory_per_rank"]})
    return {"model": MODEL.name, "global_batch": TRAIN.global_batch, "rows": rows}


def draw_memory(d: dict[str, Any], f: Any) -> None:
    ax = f.add_subplot(111)
    x, ticks = 0, []
    for r in d["rows"]:
        bottom = 0.0
        for i, k in enumerate(STATE_KEYS):
            v = r["measured"][k] / 1e6
            ax.bar(x, v, bottom=bottom, color=COLORS[i], label=k if x == 0 else None)
            bottom += v
        ax.scatter([x], [sum(r["ledger"].values()) / 1e6], color="black", marker="_", s=200,
                   zorder=3, label="ledger" if x == 0 else None)
        ticks.append(f"dp{r['dp']}\nZ{r['zero']}")
        x += 1
    ax.set_xticks(range(x), ticks, fontsize=6)
    ax.set(ylabel="model-state MB on rank 0", title="measured (bars) vs ledger (—)")
    ax.legend(fontsize=8)


def draw_traffic(d: dict[str, Any], f: Any) -> None:
    ax = f.add_subplot(111)
    dps = sorted({r["dp"] for r in d["rows"] if r["dp"] > 1})
    for j, dp in enumerate(dps):
        rows = [r for r in d["rows"] if r["dp"] == dp]
        xs = [r["zero"] + 0.3 * j for r in rows]
        ax.bar(xs, [r["measured_bytes"] / 1e6 for r in rows], width=0.28, color=COLORS[j],
               label=f"dp={dp} measured")
        ax.scatter(xs, [r["ledger_bytes"] / 1e6 for r in rows], color="black", marker="_",
                   s=120, zorder=3, label="ledger" if j == 0 else None)
    ax.set_xticks(range(4), [f"ZeRO-{z}" for z in range(4)])
    ax.set(ylabel="MB sent per rank per step (dense group)", title="traffic per stage")
    ax.legend(fontsize=8)


def figures(quick: bool, tick) -> list[Figure]:
    d = measure(quick, tick)
    how = ("two-step fived train runs on dp spawned gloo ranks; rank 0's engine.memory() and "
           "Traffic beside fived.ledger.verify.predict_rank")
    return [
        Figure("zero-memory", "ZeRO: model-state bytes per rank by stage and dp", "zero",
               "ledger+run", how, d, draw_memory),
        Figure("zero-traffic", "ZeRO: bytes per step by stage", "zero", "ledger+run", how, d,
               draw_traffic),
    ]


main = part_main("zero", figures, __doc__)
