"""Overview figures, all from the ledger (``fived.ledger``) and the grid (``fived.ranks.grid``).

* ``overview-16psi``  model-state bytes per parameter, 2 (bf16 params) + 2 (bf16 grads) + 4 (fp32
  master) + 8 (Adam m, v) = 16Ψ, and 18Ψ with an fp32 gradient buffer, for Llama 7B / 70B / 405B,
  against one device's memory (``fived.ledger.hardware.PRESETS``);
* ``overview-walls``  the memory wall (16Ψ per device without sharding, and 16Ψ/N with ZeRO-3 over
  N devices) and the time wall (6ΨD FLOPs over N devices at the device's peak);
* ``overview-map``    the 5D map: for each dimension at degree 8, the collectives the ledger
  charges to it and what it divides (model states, activations per rank) relative to degree 1;
* ``overview-grid``   a layout's rank grid, every rank coloured by its group in each dimension,
  node boundaries drawn (``Grid.partition``);
* ``overview-iron``   the iron rule for a real layout: bytes per step each group sends (ledger
  ``predict``), the link it runs on and the seconds that takes, against the compute time.

``fived figures overview --out DIR`` (no ranks are started; a second or two).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..config import PRESETS, ParallelConfig
from ._fig import COLORS, Figure, legend_below, part_main

MODELS = ("llama2-7b", "llama3-70b", "llama3-405b")
DEVICES = ("a100-80gb", "h100-sxm", "h200", "b200")
#: the layout the grid and iron-rule figures draw (tp inside a node, pp across nodes)
GRID_LAYOUT = ParallelConfig(tp=2, pp=2, dp=2, cp=1)
GRID_GPN = 4
IRON_MODEL = "llama3-70b"
IRON_LAYOUT = ParallelConfig(tp=8, pp=4, dp=8, zero=1, precision="bf16", grad_reduce_dtype="bf16",
                             micro_batches=8, sequence_parallel=True)
IRON_HW = "h100-sxm"
IRON_GLOBAL_BATCH = 512


def psi_data() -> dict[str, Any]:
    from ..ledger import memory
    from ..ledger.hardware import PRESETS as HW
    from ..ledger.params import total_params

    out: dict[str, Any] = {"models": {}, "devices": {d: HW[d].memory for d in DEVICES}}
    for reduce in ("bf16", "fp32"):
        par = ParallelConfig(precision="bf16", grad_reduce_dtype=reduce)
        out.setdefault("per_param", {})[reduce] = {
            "params": memory.param_bytes(par), "grads": memory.grad_bytes(par),
            "master": memory.master_bytes(par), "optimizer": memory.OPTIMIZER_BYTES,
            "total": memory.bytes_per_param(par)}
    for name in MODELS:
        psi = total_params(PRESETS[name])
        out["models"][name] = {"params": psi, **{
            r: {k: v * psi for k, v in out["per_param"][r].items()} for r in ("bf16", "fp32")}}
    return out


def draw_psi(d: dict[str, Any], f: Any) -> None:
    """One panel per model on a linear axis (a log axis hid the smaller stacks' parts), the
    16Ψ and 18Ψ stacks side by side, and the devices whose memory falls within the panel."""
    keys = ("params", "grads", "master", "optimizer")
    axes = f.subplots(1, len(d["models"]), squeeze=False)[0]
    for ax, (name, m) in zip(axes, d["models"].items()):
        top = 0.0
        for x, r in enumerate(("bf16", "fp32")):
            bottom = 0.0
            for i, k in enumerate(keys):
                v = m[r][k] / 1e9
                ax.bar(x, v, bottom=bottom, color=COLORS[i], width=0.6,
                       label=k if (x == 0 and ax is axes[0]) else None,
                       edgecolor="black", linewidth=0.3)
                bottom += v
            top = max(top, bottom)
            ax.text(x, bottom, f"{m[r]['total'] / 1e9:,.0f} GB", ha="center", va="bottom",
                    fontsize=8)
        for i, (dev, mem) in enumerate(d["devices"].items()):
            if mem / 1e9 <= top * 1.1:
                ax.axhline(mem / 1e9, color=COLORS[4 + i], ls="--", lw=0.9,
                           label=f"{dev} {mem / 1e9:.0f} GB")
        ax.set_ylim(0, top * 1.18)
        ax.set_xticks([0, 1], [f"{d['per_param'][r]['total']}Ψ\n({r} grads)"
                               for r in ("bf16", "fp32")])
        ax.set_title(f"{name}: {m['params'] / 1e9:.1f}B params")
    axes[0].set_ylabel("model-state bytes (GB)")
    legend_below(f, ncol=8, room=0.08)


def walls_data() -> dict[str, Any]:
    from ..ledger import compute, memory
    from ..ledger.hardware import PRESETS as HW
    from ..ledger.params import total_params

    hw = HW["h100-sxm"]
    par = ParallelConfig(precision="bf16", grad_reduce_dtype="bf16")
    per = memory.bytes_per_param(par)
    devices = [2 ** k for k in range(0, 15)]
    models = {n: total_params(PRESETS[n]) for n in ("small", "llama2-7b", "llama3-70b",
                                                   "llama3-405b")}
    tokens = {n: 20 * p for n, p in models.items()}  # Chinchilla tokens (Hoffmann et al. 2022)
    return {
        "device": hw.name, "device_memory": hw.memory, "peak_flops": hw.peak_flops,
        "bytes_per_param": per,
        "memory": {n: {"unsharded": per * p, "zero3": {str(n_): per * p / n_ for n_ in devices}}
                   for n, p in models.items()},
        "tokens": tokens,
        "time_s": {n: {str(n_): compute.training_seconds(compute.training_flops(p, tokens[n]), n_,
                                                     hw.peak_flops) for n_ in devices}
                   for n, p in models.items()},
    }


def draw_walls(d: dict[str, Any], f: Any) -> None:
    a1, a2 = f.subplots(1, 2)
    for i, (name, m) in enumerate(d["memory"].items()):
        xs = [int(k) for k in m["zero3"]]
        a1.plot(xs, [v / 1e9 for v in m["zero3"].values()], color=COLORS[i], marker=".",
                label=f"{name} (16Ψ/N)")
    a1.axhline(d["device_memory"] / 1e9, color="black", ls="--", lw=0.8,
               label=f"{d['device']} memory")
    a1.set(xscale="log", yscale="log", xlabel="devices N (ZeRO-3)",
           ylabel="model states per device (GB)", title="memory wall")
    a1.legend(fontsize=8)
    for i, (name, t) in enumerate(d["time_s"].items()):
        xs = [int(k) for k in t]
        a2.plot(xs, [v / 86400 for v in t.values()], color=COLORS[i], marker=".",
                label=f"{name}, D=20Ψ")
    a2.set(xscale="log", yscale="log", xlabel="devices N", ylabel="days at 100% of peak",
           title="time wall: 6ΨD / (N·peak)")
    a2.legend(fontsize=8)


MAP_CUTS = {"dp": "the batch (ZeRO-3: also every model state)", "tp": "each weight matrix",
            "pp": "the layers", "cp": "the sequence", "ep": "the experts"}


def map_data() -> dict[str, Any]:
    from ..ledger import memory, traffic

    rows = {}
    for dim in ("dp", "tp", "pp", "cp", "ep"):
        m = PRESETS["mixtral-8x7b" if dim == "ep" else "llama2-7b"]
        m = replace(m, seq_len=8192)
        base = ParallelConfig(precision="bf16", grad_reduce_dtype="bf16", micro_batches=8)
        par = replace(base, **{dim: 8}, zero=3 if dim == "dp" else 0)
        gb = 8 * (8 if dim in ("dp", "ep") else 1) * 8
        b = traffic.micro_batch_size(par, gb)
        one = memory.rank_memory(m, base, traffic.micro_batch_size(base, gb // (8 if dim in ("dp", "ep")
                                                                      else 1)))
        cut = memory.rank_memory(m, par, b)
        ops = sorted({f"{c.op}" for c in traffic.step_traffic(m, par, b)
                      if traffic.Collective.__name__ and c.group in (dim, "dense", "expert")
                      and c.n > 1 and (c.group == dim or dim == "dp")})
        rows[dim] = {"model": m.name, "cuts": MAP_CUTS[dim], "collectives": ops,
                     "states_ratio": cut.states_total / one.states_total,
                     "activations_ratio": cut.activations_total / one.activations_total,
                     "states_bytes": cut.states_total, "activations_bytes": cut.activations_total}
    return {"degree": 8, "rows": rows}


def draw_map(d: dict[str, Any], f: Any) -> None:
    ax = f.add_subplot(111)
    ax.axis("off")
    cells = [[dim, r["cuts"], ", ".join(r["collectives"]) or "-", f"{r['states_ratio']:.3f}",
              f"{r['activations_ratio']:.3f}", r["model"]] for dim, r in d["rows"].items()]
    t = ax.table(cells, colLabels=["dim", "cuts", "collectives (ledger)", "states ×",
                                   "activations ×", "model"], loc="center", cellLoc="left")
    t.auto_set_font_size(False)
    t.set_fontsize(7)
    t.auto_set_column_width(list(range(6)))
    t.scale(1, 1.6)
    ax.set_title(f"each dimension at degree {d['degree']}: per-rank bytes relative to degree 1")


def grid_data(par: ParallelConfig = GRID_LAYOUT, gpn: int = GRID_GPN) -> dict[str, Any]:
    from ..ranks.grid import Grid

    g = Grid.from_config(par)
    dims = [d for d in par.order if par.degree(d) > 1]
    return {"layout": {d: par.degree(d) for d in par.order}, "order": list(par.order),
            "gpus_per_node": gpn, "world": g.world_size,
            "coords": [g.coords(r) for r in range(g.world_size)],
            "groups": {d: [list(m) for m in g.partition((d,))] for d in dims},
            "crosses_node": {d: g.crosses_node((d,), gpn) for d in dims}}


def draw_grid(d: dict[str, Any], f: Any) -> None:
    from matplotlib.patches import Rectangle

    dims = list(d["groups"])
    axes = f.subplots(1, len(dims), squeeze=False)[0]
    n, gpn = d["world"], d["gpus_per_node"]
    for ax, dim in zip(axes, dims):
        for gi, members in enumerate(d["groups"][dim]):
            for r in members:
                ax.add_patch(Rectangle(
                    (r % gpn, -(r // gpn)), 0.9, 0.9, color=COLORS[gi % len(COLORS)]))
                ax.text(r % gpn + 0.45, -(r // gpn) + 0.45, str(r), ha="center", va="center",
                        color="white", fontsize=7)
        for node in range((n + gpn - 1) // gpn):
            ax.add_patch(Rectangle(
                (-0.05, -node - 0.05), gpn, 1.0, fill=False, ec="black", lw=1.2))
        ax.set_xlim(-0.2, gpn + 0.1)
        ax.set_ylim(-((n - 1) // gpn) - 0.2, 1.1)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(f"{dim}={d['layout'][dim]} groups" + (" (cross nodes)" if d["crosses_node"]
                                                          [dim] else ""), fontsize=7)


def iron_data(m: Any = None, par: ParallelConfig = IRON_LAYOUT, hw_name: str = IRON_HW,
              global_batch: int = IRON_GLOBAL_BATCH, gpn: int | None = None) -> dict[str, Any]:
    from ..ledger.hardware import PRESETS as HW
    from ..ledger.planner import predict

    m = m or PRESETS[IRON_MODEL]
    hw = HW[hw_name]
    p = predict(m, par, hw, global_batch, gpn)
    groups: dict[str, dict[str, Any]] = {}
    for c, link, secs in p.collectives:
        g = groups.setdefault(c.group, {"bytes": 0.0, "seconds": 0.0, "link": link, "ops": []})
        g["bytes"] += c.bytes
        g["seconds"] += secs
        if c.op not in g["ops"]:
            g["ops"].append(c.op)
    for g in groups.values():
        g["bandwidth"] = hw.intra_bw if g["link"] == "intra" else hw.inter_bw
    return {"model": m.name, "layout": p.name(), "hardware": hw.name, "world": par.world_size,
            "gpus_per_node": gpn or hw.gpus_per_node, "global_batch": global_batch,
            "groups": groups, "traffic": p.traffic,
            "times": p.times, "step_seconds": p.step_seconds,
            "links": {"intra": hw.intra_bw, "inter": hw.inter_bw}}


def draw_iron(d: dict[str, Any], f: Any) -> None:
    a1, a2 = f.subplots(1, 2)
    names = list(d["groups"])
    g = d["groups"]
    a1.bar(names, [g[n]["bytes"] / 1e9 for n in names],
           color=[COLORS[0] if g[n]["link"] == "intra" else COLORS[3] for n in names])
    for i, n in enumerate(names):
        a1.text(i, g[n]["bytes"] / 1e9, f"{g[n]['link']}\n{g[n]['bandwidth'] / 1e9:.0f} GB/s",
                ha="center", va="bottom", fontsize=7)
    a1.set(ylabel="GB sent per rank per step (log)", title="bytes per dimension (ledger)",
           yscale="log")
    if names:  # room above the tallest bar for its two-line label (a log axis: ×8)
        lo = min(g[n]["bytes"] for n in names if g[n]["bytes"] > 0) / 1e9
        a1.set_ylim(lo / 3, max(g[n]["bytes"] for n in names) / 1e9 * 8)
    a2.bar(names, [g[n]["seconds"] for n in names],
           color=[COLORS[0] if g[n]["link"] == "intra" else COLORS[3] for n in names])
    comp = sum(v for k, v in d["times"].items() if k in ("forward", "backward", "compute"))
    if comp:
        a2.axhline(comp, color="black", ls="--", lw=0.8, label="compute per step")
        a2.legend(fontsize=8)
    a2.set(ylabel="seconds per step on its link (log)", title="bytes / link bandwidth",
           yscale="log")
    a1.set_xlabel("group")
    a2.set_xlabel("group")


def figures(quick: bool, tick) -> list[Figure]:
    del quick  # the ledger is instant
    tick("overview: ledger")
    iron = iron_data()
    return [
        Figure("overview-16psi", "Model states: 16Ψ (bf16 grads) and 18Ψ (fp32 grad buffer)",
               "overview", "ledger", "fived.ledger.memory bytes per parameter × "
               "fived.ledger.params.total_params of each preset; device memory from "
               "fived.ledger.hardware.PRESETS", psi_data(), draw_psi, size=(9.0, 4.4)),
        Figure("overview-walls", "The two walls: memory per device and training time",
               "overview", "ledger", "16Ψ/N (fived.ledger.memory.bytes_per_param) and "
               "fived.ledger.compute.training_seconds(6ΨD, N, peak) with D = 20Ψ tokens",
               walls_data(), draw_walls, size=(9.0, 4.0)),
        Figure("overview-map", "The 5D map: what each dimension cuts, sends and saves",
               "overview", "ledger", "fived.ledger.traffic.step_traffic (collectives) and "
               "fived.ledger.memory.rank_memory at degree 8 over degree 1", map_data(), draw_map,
               size=(9.0, 2.6)),
        Figure("overview-grid", f"The grid of {GRID_LAYOUT.describe()}: ranks by group, "
               f"{GRID_GPN} GPUs per node", "overview", "ledger",
               "fived.ranks.grid.Grid.partition per dimension (what `fived grid` prints)",
               grid_data(), draw_grid, size=(9.0, 2.8)),
        Figure("overview-iron", f"The iron rule: {iron['model']} {iron['layout']} on "
               f"{iron['world']}× {iron['hardware']}", "overview", "ledger",
               "fived.ledger.planner.predict: every collective's bytes and its link time",
               iron, draw_iron, size=(9.0, 3.6)),
    ]


main = part_main("overview", figures, __doc__)
