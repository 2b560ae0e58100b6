"""Part 5, Megatron's two cuts: the shapes each tp rank holds, the bytes per layer, tp scaling.

* ``tensor-shapes``   one block cut over tp on spawned ranks (``parallelize_parts``): each rank's
  local shape of q/k/v/o and gate/up/down, and the placement's cut dimension (column = the
  output dim, rows of the weight; row = the input dim) — what the runtime actually holds;
* ``tensor-bytes``    bytes the ``tp`` group sends per layer per step, measured as the difference
  of two ``fived train`` runs that differ by two layers (so the vocab-parallel embedding and loss
  cancel), without and with sequence parallelism, beside the ledger's per-layer bytes
  (``fived.ledger.traffic.tp_traffic``, the same difference);
* ``tensor-scaling``  median step time of the same model at tp = 1, 2, 4 (on this 2-core CPU the
  ranks share cores, so this shows the overhead, not a speed-up), and the tp bytes per step.

``fived figures tensor --out DIR [--quick]`` (quick: tp ∈ {1, 2}).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from ..config import ModelConfig, ParallelConfig, TrainConfig
from ._fig import COLORS, Figure, part_main

MODEL = ModelConfig(name="fig-tp", vocab=256, hidden=64, layers=2, heads=4, kv_heads=4,
                    ffn=176, seq_len=32)
TRAIN = TrainConfig(steps=3, global_batch=4, seed=11, corpus_mb=1.0, warmup=1)
WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shapes_rank(rank: int, world: int) -> dict[str, Any]:
    from ..comm.ops import Traffic
    from ..model import build_model
    from ..parallel.parallelize import parallelize_parts
    from ..ranks.grid import Grid

    par = ParallelConfig(tp=world)
    grid = Grid.from_config(par, rank).connect(Traffic())
    (part,), pl = parallelize_parts(build_model(MODEL, TRAIN.seed), grid, par)
    out = {}
    for name, p in part.named_parameters():
        if name.startswith("layers.0.") and name.split(".")[-2] in WEIGHTS:
            w = name.split(".")[-2]
            out[w] = {"local": list(p.shape), "global": list(pl[name].shape), "dim": pl[name].dim,
                      "parts": pl[name].parts, "index": pl[name].index}
    return out


def measure(quick: bool, tick) -> dict[str, Any]:
    from ..ledger.traffic import micro_batch_size, tp_traffic
    from ..testing import run_ranks
    from ._runs import train_many

    tps = [1, 2] if quick else [1, 2, 4]
    tick(f"tensor: shapes on {tps[-1]} ranks")
    shapes = run_ranks(shapes_rank, tps[-1], timeout=300)
    runs = []
    for tp in tps:
        for sp in ([False, True] if tp > 1 else [False]):
            for layers in (2, 4):
                runs.append((replace(MODEL, layers=layers), ParallelConfig(
                    tp=tp, sequence_parallel=sp), TRAIN))
    tick(f"tensor: {len(runs)} three-step runs, tp ∈ {tps}")
    res = train_many(runs)
    rows = []
    for (m, par, _), r in zip(runs, res):
        mb = micro_batch_size(par, TRAIN.global_batch)
        ledger = sum(c.bytes for c in tp_traffic(m, par, mb) if c.group == "tp")
        rows.append({"tp": par.tp, "sp": par.sequence_parallel, "layers": m.layers,
                     "measured_bytes": r["traffic_per_rank"][0]["bytes"].get("tp", 0.0),
                     "ledger_bytes": ledger,
                     "step_s": statistics.median(r["seconds"][1:])})
    per_layer = []
    for tp in tps[1:]:
        for sp in (False, True):
            a, b = (next(x for x in rows if x["tp"] == tp and x["sp"] == sp and x["layers"] == L)
                    for L in (2, 4))
            per_layer.append({"tp": tp, "sp": sp,
                              "measured": (b["measured_bytes"] - a["measured_bytes"]) / 2,
                              "ledger": (b["ledger_bytes"] - a["ledger_bytes"]) / 2})
    return {"model": MODEL.name, "tps": tps, "shapes": shapes, "rows": rows,
            "per_layer": per_layer, "global_batch": TRAIN.global_batch}


def draw_shapes(d: dict[str, Any], f: Any) -> None:
    from matplotlib.patches import Rectangle

    shapes = d["shapes"]
    n = len(shapes)
    axes = f.subplots(1, len(WEIGHTS))
    for ax, w in zip(axes, WEIGHTS):
        g = shapes[0][w]["global"]
        for r in range(n):
            s = shapes[r][w]
            dim, idx = s["dim"], s["index"]
            h, wd = s["local"]
            y0 = (idx * h) if dim == 0 else 0
            x0 = (idx * wd) if dim == 1 else 0
            ax.add_patch(Rectangle((x0, -y0 - h), wd, h, color=COLORS[r], alpha=0.7))
        ax.set_xlim(0, g[1])
        ax.set_ylim(-g[0], 0)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        cut = {0: "column", 1: "row"}.get(shapes[0][w]["dim"], "replicated")
        ax.set_title(f"{w}\n{cut}: {shapes[0][w]['local']}", fontsize=6)
    axes[0].set_ylabel(f"tp={n}: colour = rank")


def draw_bytes(d: dict[str, Any], f: Any) -> None:
    ax = f.add_subplot(111)
    labels = [f"tp{r['tp']}" + ("+SP" if r["sp"] else "") for r in d["per_layer"]]
    ax.bar(labels, [r["measured"] / 1e3 for r in d["per_layer"]], color=COLORS[0],
           label="measured (runs differing by 2 layers)")
    ax.scatter(labels, [r["ledger"] / 1e3 for r in d["per_layer"]], marker="_", s=300,
               color="black", zorder=3, label="ledger")
    ax.set(ylabel="KB sent per rank per layer per step (tp group)")
    ax.legend(fontsize=8)


def draw_scaling(d: dict[str, Any], f: Any) -> None:
    a1, a2 = f.subplots(1, 2)
    for j, sp in enumerate((False, True)):
        rows = [r for r in d["rows"] if r["layers"] == 4 and (r["sp"] == sp or r["tp"] == 1)]
        a1.plot([r["tp"] for r in rows], [r["step_s"] * 1e3 for r in rows], marker="o",
                color=COLORS[j], label="tp+SP" if sp else "tp")
        a2.plot([r["tp"] for r in rows], [r["measured_bytes"] / 1e3 for r in rows], marker="o",
                color=COLORS[j], label="tp+SP" if sp else "tp")
    a1.set(xlabel="tp", ylabel="median step ms (4 layers)", title="step time")
    a2.set(xlabel="tp", ylabel="KB per rank per step", title="tp bytes")
    for ax in (a1, a2):
        ax.set_xticks(d["tps"])
        ax.legend(fontsize=8)


def figures(quick: bool, tick) -> list[Figure]:
    d = measure(quick, tick)
    how = ("three-step fived train runs on tp spawned gloo ranks; rank 0's Traffic['tp'] "
           "beside fived.ledger.traffic.tp_traffic")
    return [
        Figure("tensor-shapes", f"Column and row cuts: one block over tp={d['tps'][-1]}",
               "tensor", "run", "parallelize_parts on spawned ranks: each rank's local "
               "parameter shape and its Placement", d, draw_shapes, size=(10.0, 3.0)),
        Figure("tensor-bytes", "Tensor-parallel bytes per layer (measured vs ledger)", "tensor",
               "ledger+run", how, d, draw_bytes),
        Figure("tensor-scaling", "tp scaling on this machine", "tensor", "run", how, d,
               draw_scaling, size=(8.0, 3.4)),
    ]


main = part_main("tensor", figures, __doc__)
