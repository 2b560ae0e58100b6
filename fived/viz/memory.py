"""Part 10, memory: one step of one rank, its live bytes phase by phase — the ledger's stack of
what is kept and what is in flight, and the dry run's measured peak beside it.

* the bars: ``fived.ledger.peak.step_phases`` for the rank's pipeline coordinate, one bar per
  phase in the runtime's order (each F / B / W of the schedule, then ``reduce``, ``clip``,
  ``optimizer``), stacked as ``live = kept + saved + Σ transients``: the model states
  (``memory.model_states``: params, grads, master, optimizer state) and the step's inputs
  (``peak.step_input_bytes``: token ids, targets, positions), the saved activations of
  the micro-batches in flight, and each transient by name — communication buffers hatched
  (``grad_recv``, ``sp_gather``, ``cp_ring``, ``ep_a2a``, ``zero_buffers``), compute
  temporaries plain (``block_backward``, ``loss_backward``, ``recompute_block``, ``clip``,
  ``optimizer``);
* the black line: the same rank's dry run (``fived.train.dryrun.dry_run_rank``: the real
  trainer on fake tensors, every storage's life traced by ``fived.train.memtrace.LiveTensors``)
  — the most bytes live at once inside each phase;
* the lower panel: dry run − ledger in each phase, in % of the ledger;
* the peak of each, marked and labelled with its phase and bytes.

``fived figures memory --out DIR`` draws the series' two layouts of the ``small`` model (pp2,
and tp2·pp2·dp2; fp32, global batch 16 in 4 micro-batches); with any model or layout flag
(``--model``, ``--tp``, ``--pp``, ``--zero``, ... as ``fived train`` takes them, or
``--config``) it draws that layout. ``--rank R``: the rank drawn (default: the pipeline rank
whose ledger peak is highest, coordinate 0 in every other dimension). ``--precision auto``
resolves as ``fived train`` resolves it (fp32 on a machine without cuda); the dry run of a
layout takes seconds for the small presets and grows with the model, not the world.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import replace
from typing import Any

from ..config import ConfigError, ModelConfig, ParallelConfig, TrainConfig, preset
from ._fig import Figure, add_args, run_part, save

#: transients that are communication buffers (the rest are compute temporaries)
COMM = ("grad_recv", "sp_gather", "cp_ring", "ep_a2a", "zero_buffers")
KEPT = ("params", "grads", "master", "optimizer")
KEPT_LABELS = {"params": "params", "grads": "grads", "master": "master (fp32)",
               "optimizer": "optimizer state"}
KEPT_COLORS = {"params": "#4C72B0", "grads": "#64B5CD", "master": "#8172B3",
               "optimizer": "#55A868", "inputs": "#1B3A5C"}
SAVED_COLOR = "#CCB974"
COMM_COLORS = ["#C44E52", "#DA8BC3", "#937860", "#E17C05", "#8C2D04"]
COMPUTE_COLORS = ["#DD8452", "#8C8C8C", "#F2B701", "#7F3C8D", "#11A579"]

#: the series' layouts (``fived figures all``): the small model, one pipeline, then 3D
SERIES_MODEL = "small"
SERIES = (ParallelConfig(pp=2, micro_batches=4, precision="fp32"),
          ParallelConfig(tp=2, pp=2, dp=2, micro_batches=4, precision="fp32"))
SERIES_TRAIN = TrainConfig(model=SERIES_MODEL, global_batch=16)


# ------------------------------------------------------------------ the numbers
def group_of(transient: str) -> str:
    return "comm" if transient in COMM else "compute"


def slug(text: str) -> str:
    """``pp2·dp2·tp2`` -> ``pp2-dp2-tp2`` (a file name)."""
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def default_rank(m: ModelConfig, par: ParallelConfig, global_batch: int,
                 optimizer: str = "adamw") -> int:
    """The global rank at the pipeline coordinate whose ledger peak is highest
    (``peak.largest_rank``), coordinate 0 in every other dimension."""
    from ..ledger.peak import largest_rank
    from ..ledger.traffic import micro_batch_size
    from ..ranks.grid import Grid

    top = largest_rank(m, par, micro_batch_size(par, global_batch), optimizer=optimizer)
    return Grid.from_config(par).rank_of(pp=top.pp_rank)


def ledger_data(m: ModelConfig, par: ParallelConfig, global_batch: int, rank: int,
                optimizer: str = "adamw") -> dict[str, Any]:
    """The ledger's step of ``rank``: phase names, the stack by category, totals, the peak."""
    from ..ledger.memory import model_states
    from ..ledger.peak import step_phases
    from ..ledger.traffic import micro_batch_size
    from ..ledger.verify import coords, group_index

    b = micro_batch_size(par, global_batch)
    pp = coords(par, rank)["pp"]
    dense, expert = group_index(par, "dense", rank), group_index(par, "expert", rank)
    phases = step_phases(m, par, b, pp, optimizer=optimizer, dense_index=dense,
                         expert_index=expert)
    states = model_states(m, par, pp, dense, expert, optimizer)
    seen = list(dict.fromkeys(k for p in phases for k in p.transients))
    names = sorted(seen, key=lambda k: (group_of(k) != "comm", seen.index(k)))  # comm first
    stack = [{"key": f"kept.{k}", "label": KEPT_LABELS[k], "group": "kept",
              "bytes": [float(states.get(k, 0))] * len(phases)} for k in KEPT]
    held = sum(float(states.get(k, 0)) for k in KEPT)  # the rest of kept: the step's inputs
    stack.append({"key": "kept.inputs", "label": "step inputs (ids, targets, positions)",
                  "group": "kept", "bytes": [p.kept - held for p in phases]})
    stack.append({"key": "saved", "label": "saved activations", "group": "saved",
                  "bytes": [p.saved for p in phases]})
    for k in names:
        g = group_of(k)
        what = "comm buffer" if g == "comm" else "temporary"
        stack.append({"key": f"transient.{k}", "label": f"{k} ({what})", "group": g,
                      "bytes": [float(p.transients.get(k, 0.0)) for p in phases]})
    totals = [p.total for p in phases]
    i = max(range(len(phases)), key=lambda j: totals[j])  # the first of equals, as step_peak
    p = phases[i]
    return {"micro_batch": b, "pp_rank": pp, "phases": [p.name for p in phases],
            "kept_states": {k: float(states.get(k, 0)) for k in KEPT},
            "stack": stack, "total": totals,
            "peak": {"index": i, "phase": p.name, "bytes": p.total, "kept": p.kept,
                     "saved": p.saved, "transients": {k: v for k, v in p.transients.items() if v},
                     "largest_transient": p.largest}}


def measured_data(rec: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The dry run's record on the ledger's phases: the most live inside each (None where the
    run has no such phase), its own full series and its step peak."""
    by_name = {p[0]: p for p in rec["phases"]}
    peak = [float(by_name[n][2]) if n in by_name else None for n in names]
    index = names.index(rec["peak_phase"]) if rec["peak_phase"] in names else None
    return {"phases": rec["phases"], "peak_by_phase": peak,
            "not_in_ledger": [p[0] for p in rec["phases"]
                              if p[0] not in names and p[0] not in ("build", "end")],
            "peak": {"index": index, "phase": rec["peak_phase"], "bytes": float(rec["peak"])},
            "kept_states": {k: float(rec["memory"].get(k, 0)) for k in KEPT},
            "seconds": rec.get("wall_seconds", 0.0)}


def dry_run(m: ModelConfig, par: ParallelConfig, train: TrainConfig, rank: int
            ) -> dict[str, Any]:
    """``dry_run_rank`` of one rank, timed."""
    from ..train.dryrun import dry_run_rank

    t = time.perf_counter()
    rec = dry_run_rank(m, par, train, rank)
    rec["wall_seconds"] = time.perf_counter() - t
    return rec


def unit_for(n: float) -> tuple[str, float]:
    for name, div in (("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10)):
        if n >= 2 * div:
            return name, div
    return "B", 1.0


def layout_data(m: ModelConfig, par: ParallelConfig, train: TrainConfig, rank: int | None = None,
                rec: dict[str, Any] | None = None, tick=None) -> dict[str, Any]:
    """Everything the figure plots for one rank of one layout (``rec``: a dry run already made
    of that rank; None: run it)."""
    gb = train.global_batch
    if rank is None:
        rank = default_rank(m, par, gb, train.optimizer)
    led = ledger_data(m, par, gb, rank, train.optimizer)
    if rec is None:
        if tick:
            tick(f"memory: dry run of {m.name} {par.describe()} rank {rank}")
        rec = dry_run(m, par, train, rank)
    meas = measured_data(rec, led["phases"])
    diff = [None if v is None else (v - t) for v, t in zip(meas["peak_by_phase"], led["total"])]
    unit, scale = unit_for(max([*led["total"], meas["peak"]["bytes"]]))
    lp, mp = led["peak"]["bytes"], meas["peak"]["bytes"]
    return {"model": m.name, "layout": par.describe(), "precision": par.precision,
            "schedule": par.schedule if par.pp > 1 else "", "virtual_stages": par.virtual_stages,
            "recompute": par.recompute,
            "micro_batches": par.micro_batches, "global_batch": gb, "seq_len": m.seq_len,
            "optimizer": train.optimizer, "rank": rank, "coords": rec.get("coords", {}),
            "unit": unit, "scale": scale, "ledger": led, "measured": meas,
            "diff_by_phase": diff,
            "peak_diff": {"bytes": mp - lp, "fraction": (mp - lp) / lp if lp else 0.0,
                          "same_phase": led["peak"]["phase"] == meas["peak"]["phase"]}}


# ------------------------------------------------------------------ the picture
def fmt(n: float) -> str:
    from ..ledger.memory import fmt_bytes

    return fmt_bytes(n)


def colors(stack: list[dict[str, Any]]) -> list[str]:
    out, comm, compute = [], iter(COMM_COLORS * 3), iter(COMPUTE_COLORS * 3)
    for s in stack:
        if s["group"] == "kept":
            out.append(KEPT_COLORS[s["key"].split(".", 1)[1]])
        elif s["group"] == "saved":
            out.append(SAVED_COLOR)
        else:
            out.append(next(comm) if s["group"] == "comm" else next(compute))
    return out


def draw(d: dict[str, Any], f: Any) -> None:
    led, meas = d["ledger"], d["measured"]
    names, scale, unit = led["phases"], d["scale"], d["unit"]
    n = len(names)
    x = list(range(n))
    gs = f.add_gridspec(2, 1, height_ratios=(3.2, 1))
    ax = f.add_subplot(gs[0])
    dx = f.add_subplot(gs[1], sharex=ax)
    bottom = [0.0] * n
    for s, c in zip(d["ledger"]["stack"], colors(led["stack"])):
        if not any(s["bytes"]):
            continue
        v = [b / scale for b in s["bytes"]]
        ax.bar(x, v, 0.8, bottom=bottom, color=c, label=s["label"], edgecolor="white", lw=0.4,
               hatch="////" if s["group"] == "comm" else None)
        bottom = [a + b for a, b in zip(bottom, v)]
    mx = [i for i, v in enumerate(meas["peak_by_phase"]) if v is not None]
    ax.plot(mx, [meas["peak_by_phase"][i] / scale for i in mx], color="black", marker="o",
            ms=3.5, lw=1.1, label="dry run: most live in the phase", zorder=4)
    top = max([*led["total"], meas["peak"]["bytes"]]) / scale
    ax.set_ylim(0, top * 1.42)
    lp, mp = led["peak"], meas["peak"]
    # the labels sit above the bars (x: beside the peak, toward the middle; y: in axes
    # fractions, the ledger's on top), so that they never cover each other or the bars
    right = lp["index"] < n / 2
    ha, side = ("left", 1) if right else ("right", -1)
    a = ax.annotate(f"ledger peak {fmt(lp['bytes'])}\n{lp['phase']}"
                    + (f" (largest transient: {lp['largest_transient']})"
                       if lp["largest_transient"] else ""),
                    xy=(lp["index"], lp["bytes"] / scale), xytext=(lp["index"] + 0.3 * side, 0.97),
                    textcoords=("data", "axes fraction"), ha=ha, va="top", fontsize=7,
                    arrowprops={"arrowstyle": "-|>", "color": "#C44E52", "lw": 1.0},
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "#C44E52", "lw": 0.6})
    a.set_gid("ledger-peak")
    ax.plot([lp["index"]], [lp["bytes"] / scale], marker="v", color="#C44E52", ms=6, zorder=5)
    if mp["index"] is not None:
        b = ax.annotate(f"dry-run peak {fmt(mp['bytes'])}\n{mp['phase']}",
                        xy=(mp["index"], mp["bytes"] / scale),
                        xytext=(mp["index"] + 1.3 * side, 0.84),
                        textcoords=("data", "axes fraction"), ha=ha, va="top", fontsize=7,
                        arrowprops={"arrowstyle": "-|>", "color": "black", "lw": 1.0},
                        bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "black",
                              "lw": 0.6})
        b.set_gid("measured-peak")
        ax.plot([mp["index"]], [mp["bytes"] / scale], marker="*", color="black", ms=9, zorder=5)
    where = ", ".join(f"{k}{v}" for k, v in d["coords"].items() if v) or "coordinate 0"
    sched = f", {d['schedule']}" + (f" v{d['virtual_stages']}" if d["virtual_stages"] > 1 else "") \
        if d["schedule"] else ""
    ax.set_title(f"rank {d['rank']} ({where}) · {d['precision']} · {d['micro_batches']} "
                 f"micro-batches of {led['micro_batch']}×{d['seq_len']} tokens{sched}",
                 fontsize=8)
    ax.set_ylabel(f"live bytes ({unit})")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0),
              fontsize=7, frameon=False, title="ledger (stacked), top first",
              title_fontsize=7)
    ax.tick_params(labelbottom=False)
    pct = [None if v is None else 100 * v / t if t else 0.0
           for v, t in zip(d["diff_by_phase"], led["total"])]
    px = [i for i, v in enumerate(pct) if v is not None]
    dx.bar(px, [pct[i] for i in px], 0.8, color=["#C44E52" if pct[i] > 0 else "#4C72B0"
                                                for i in px])
    dx.axhline(0, color="black", lw=0.6)
    dx.set_ylabel("dry run − ledger\n(% of ledger)", fontsize=7)
    step = max(1, n // 48)
    dx.set_xticks(x[::step], names[::step], rotation=90 if n > 14 else 45,
                  ha="center" if n > 14 else "right", fontsize=6.5 if n > 14 else 7)
    dx.set_xlim(-0.6, n - 0.4)
    dx.set_xlabel("phase of the step, in the order it runs\nF|B|W mb s: forward | backward | "
                  "weight gradient of micro-batch mb on stage s", fontsize=7)


def figure_of(d: dict[str, Any], name: str) -> Figure:
    led = d["ledger"]
    n = len(led["phases"])
    rows: list[list[Any]] = [["phase", "kept", "saved", "transients", "ledger", "dry run",
                              "diff"]]
    saved = next(s["bytes"] for s in led["stack"] if s["key"] == "saved")
    for i, ph in enumerate(led["phases"]):
        t = led["total"][i]
        kept = sum(s["bytes"][i] for s in led["stack"] if s["group"] == "kept")
        mv = d["measured"]["peak_by_phase"][i]
        rows.append([ph, fmt(kept), fmt(saved[i]), fmt(t - kept - saved[i]), fmt(t),
                     "-" if mv is None else fmt(mv),
                     "-" if mv is None else f"{(mv - t) / t:+.2%}" if t else "-"])
    return Figure(name, f"{d['model']} {d['layout']}, rank {d['rank']}: one step's live bytes, "
                  "the ledger's stack beside the dry run", "memory", "ledger+run",
                  "fived.ledger.peak.step_phases (kept = memory.model_states; saved activations; "
                  "transients by name) beside fived.train.dryrun.dry_run_rank's per-phase peak "
                  "(fived.train.memtrace.LiveTensors on fake tensors)", d, draw,
                  size=(min(16.0, max(8.0, 0.3 * n + 5.0)), 5.6), table=rows)


def figure_name(d: dict[str, Any]) -> str:
    """``memory-MODEL-LAYOUT[-SCHEDULE][-recompute-R]-rankN`` (the schedule when not 1F1B)."""
    extra = "".join(f"-{slug(v)}" for v in (
        d["schedule"] if d["schedule"] not in ("", "1f1b") else "",
        f"recompute {d['recompute']}" if d["recompute"] != "none" else "") if v)
    return f"memory-{slug(d['model'])}-{slug(d['layout'])}{extra}-rank{d['rank']}"


def figures(quick: bool, tick) -> list[Figure]:
    """The series: ``small`` at pp2 and at tp2·pp2·dp2, each on its highest-peak rank (the same
    sizes with --quick: each dry run takes seconds)."""
    m = preset(SERIES_MODEL)
    out = []
    for par in SERIES:
        d = layout_data(m, par, SERIES_TRAIN, tick=tick)
        out.append(figure_of(d, figure_name(d)))
    return out


# ------------------------------------------------------------------ the command
def table_lines(recs: list[dict[str, Any]]) -> list[str]:
    """What was measured: one line per figure (80 columns unless a layout's name is long)."""
    w = max([6] + [len(r["data"]["layout"]) for r in recs])
    head = f"{'layout':<{w}} {'rank':>5} {'ledger peak':>11} {'dry run':>10} {'diff':>7}  phase"
    lines = [head, "-" * len(head)]
    for r in recs:
        d = r["data"]
        lp, mp = d["ledger"]["peak"], d["measured"]["peak"]
        phase = lp["phase"] if lp["phase"] == mp["phase"] else f"{lp['phase']} / {mp['phase']}"
        lines.append(f"{d['layout']:<{w}} {d['rank']:>5} {fmt(lp['bytes']):>11} "
                     f"{fmt(mp['bytes']):>10} {d['peak_diff']['fraction']:>+7.2%}  {phase}")
    return lines


LAYOUT_FLAGS = ("model", "seq_len", "mlp", "positions", "norm", "bias", "tp", "cp", "ep", "dp",
                "pp", "zero", "zero3_pp_gather", "schedule", "virtual_stages", "micro_batches",
                "sequence_parallel", "recompute", "precision", "grad_reduce_dtype",
                "master_weights", "cp_mode", "ep_dispatch", "order", "bucket_mb", "pp_layers",
                "zero_align", "global_batch", "optimizer")


def parser() -> argparse.ArgumentParser:
    from ..ui import flags
    from ..ui.args import Parser

    ap = Parser(prog="fived figures memory", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    ap.add_argument("--rank", type=int, default=None, metavar="R",
                    help="the rank drawn (default: the pipeline rank with the highest ledger "
                         "peak, coordinate 0 in every other dimension)")
    flags.add_config_flags(ap, only=LAYOUT_FLAGS, notes={
        "model": "any of these flags (or --config) draws that layout instead of the series'"})
    return ap


def resolve(a: argparse.Namespace) -> tuple[ModelConfig, ParallelConfig, TrainConfig]:
    """The layout the flags give, as ``fived train --dry-run`` would run it."""
    from ..config import fill_dp, resolve_precision, validate
    from ..ranks.launch import cuda_expected
    from ..ui import flags

    res = flags.configs(a)
    par, world = fill_dp(res.par, res.dp_given, None)
    gpu = cuda_expected()  # --precision auto as fived train resolves it
    par, _ = resolve_precision(par, gpu, "cuda" if gpu else "cpu")
    train = res.train
    validate(res.model, par, train, world)
    if a.rank is not None and not 0 <= a.rank < par.world_size:
        raise ConfigError([f"--rank {a.rank}: the layout {par.describe()} has ranks "
                           f"0..{par.world_size - 1}"])
    return res.model, par, train


def main(argv: list[str] | None = None) -> int:
    from ..ui import flags
    from ._fig import progress

    argv = sys.argv[1:] if argv is None else list(argv)
    a = parser().parse_args(argv)
    res = flags.configs(a)
    custom = bool(res.given) or bool(a.config)
    if a.rank is not None and not custom:
        raise ConfigError(["--rank: name the layout too (--model, --tp, --pp, ... or --config); "
                           "without one the series' layouts are drawn, each on its own rank"])
    if custom:
        m, par, train = resolve(a)
        if a.print_config:
            return flags.print_config(replace(res, model=m, par=par, train=train),
                                      "fived figures memory: the layout drawn")
        what = f"{m.name} {par.describe()} ({par.precision})"
    elif a.print_config:
        raise ConfigError(["--print-config: no layout given; the series draws "
                           + " and ".join(f"{SERIES_MODEL} {p.describe()}" for p in SERIES)
                           + " (give --model/--tp/--pp/... to draw and print one)"])
    else:
        what = f"the series' layouts of {SERIES_MODEL}"
    print(f"fived figures memory: {what} → {a.out}/", flush=True)
    t0 = time.perf_counter()
    with progress(1) as bar:
        task = bar.add_task("memory", total=1)

        def tick(text: str) -> None:
            bar.update(task, description=text)
            if not bar.console.is_terminal:
                bar.console.print(f"  {text}")

        if custom:
            d = layout_data(m, par, train, a.rank, tick=tick)
            tick(f"memory: drawing {figure_name(d)}")
            recs = [save(figure_of(d, figure_name(d)), a.out,
                         "fived figures memory " + " ".join(argv))]
        else:
            recs = run_part("memory", figures, a.out, a.quick, tick)
        bar.update(task, advance=1, description="memory: done")
    print(f"{len(recs)} figure(s) in {a.out}/ in {time.perf_counter() - t0:.0f} s:")
    for r in recs:
        print(f"  {r['name']}.png .svg .json")
    print()
    for line in table_lines(recs):
        print(line)
    print("bytes binary (KiB, MiB, GiB); diff = (dry run − ledger) / ledger, peak against\n"
          "peak; phase: the peak's (ledger / dry run where they differ), F|B|W mb stage")
    return 0
