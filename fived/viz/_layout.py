"""The one-layout page of ``fived report --tp 2 --pp 2 --dp 2``: its summary, figures and tables.

Everything here comes from the ledger (``fived.ledger``) and the executor's own schedule lists
(``fived.parallel.pipeline.schedules``), for the layout the flags give, exactly as ``fived
ledger`` and ``fived train`` read them:

* the summary: fits or not, the peak per rank, the step time, where it goes, what to change
  (``fived.ui.ledger_view.advice``, the ledger's own sentences);
* ``layout-memory``: memory per pipeline rank stacked by category — every ``*_total`` of
  ``fived.ledger.memory.rank_memory`` (states, activations, buffers, and whatever category
  the ledger adds) — and the step's peak (``fived.ledger.peak.with_peak``: what decides
  whether it fits), against the device's usable memory;
* ``layout-schedule``: the pipeline schedule's timeline (pp > 1);
* ``layout-iron``: bytes and link seconds per group (``fived.ledger.planner.predict``);
* HTML tables: the grid (every rank's coordinates, by node), the traffic per group, and the
  planner's alternatives (``fived.ledger.planner.plan`` on the same model, GPUs and batch).
"""

from __future__ import annotations

import html
from argparse import Namespace
from typing import Any

from ._fig import COLORS, Figure, legend_below

#: the time components, as the page names them
TIME_NAMES = {"compute": "compute", "memory_bound": "memory-bound ops", "recompute": "recompute",
              "tp": "tp comm", "ep": "ep comm", "cp": "cp comm", "pp_p2p": "pp sends",
              "zero_per_micro": "ZeRO comm", "bubble": "pipeline bubble", "dp": "dp comm",
              "optimizer": "optimizer", "runtime": "runtime", "time_shared": "shared cores"}


def _gb(x: float) -> str:
    from ..ui.report import fmt_b

    return fmt_b(x)


def memory_data(m: Any, par: Any, micro_batch: int, usable: float) -> dict[str, Any]:
    """Per pipeline rank: every ``*_total`` category of the ledger's ``rank_memory``."""
    from ..ledger.memory import FUSED, rank_memory
    from ..ledger.peak import with_peak

    ranks = []
    for r in range(par.pp):
        d = with_peak(rank_memory(m, par, micro_batch, r, FUSED), m, par, micro_batch,
                      FUSED).as_dict()
        ranks.append({"pp_rank": r, "total": d["total"], "peak": d["peak"],
                      "peak_phase": d["peak_phase"],
                      **{k[:-len("_total")]: v for k, v in d.items()
                         if k.endswith("_total") and isinstance(v, (int, float))}})
    cats = [k for k in ranks[0] if k not in ("pp_rank", "total", "peak", "peak_phase")]
    return {"ranks": ranks, "categories": cats, "usable": usable}


def draw_memory(d: dict[str, Any], f: Any) -> None:
    ax = f.add_subplot(111)
    xs = [r["pp_rank"] for r in d["ranks"]]
    peak = max(max(r["total"], r["peak"]) for r in d["ranks"])
    unit, div = next((u, v) for u, v in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3),
                                         ("B", 1.0)) if peak >= v or v == 1.0)
    bottom = [0.0] * len(xs)
    for i, c in enumerate(d["categories"]):
        v = [r[c] / div for r in d["ranks"]]
        ax.bar(xs, v, bottom=bottom, color=COLORS[i % len(COLORS)], label=c, width=0.6,
               edgecolor="black", linewidth=0.3)
        bottom = [b + x for b, x in zip(bottom, v)]
    peaks = [r["peak"] / div for r in d["ranks"]]
    ax.hlines(peaks, [x - 0.3 for x in xs], [x + 0.3 for x in xs], colors="black", lw=2.5,
              zorder=3, label="step peak (kept + saved + transients)")
    for x, t in zip(xs, peaks):
        ax.text(x, t, f"peak {t:,.1f} {unit}", ha="center", va="bottom", fontsize=8)
    usable = d["usable"] / div
    top = max(max(bottom), max(peaks))
    if usable <= 3 * top:  # the device's line where it can be read beside the bars
        ax.axhline(usable, color="black", ls="--", lw=0.9, label="usable device memory")
        top = max(top, usable)
        ax.set_title("against the device's usable memory (dashed)")
    else:
        ax.set_title(f"the device's usable {d['usable'] / 1e9:,.0f} GB is "
                     f"{d['usable'] / peak:,.0f}× the peak: off this scale")
    ax.set_ylim(0, top * 1.15)
    ax.set_xticks(xs, [f"pp rank {x}" for x in xs])
    ax.set(ylabel=f"{unit} per rank", xlabel="pipeline rank (every tp/cp/ep/dp rank alike)")
    legend_below(f, ncol=5, room=0.1)


def schedule_data(par: Any) -> dict[str, Any]:
    from .. import schedules

    v = max(1, par.virtual_stages)
    sched = schedules.build(par.schedule, par.pp, par.micro_batches, v)
    t = schedules.simulate(sched)
    return {"schedule": par.schedule, "pp": par.pp, "micro_batches": par.micro_batches,
            "virtual": v, "makespan": t.makespan, "bubble": t.bubble_fraction()}


def draw_schedule(d: dict[str, Any], f: Any) -> None:
    from .. import schedules
    from .schedule import draw_on

    sched = schedules.build(d["schedule"], d["pp"], d["micro_batches"], d["virtual"])
    draw_on(f.add_subplot(111), sched, schedules.simulate(sched))


def figures(res: Any, hw_name: str, gpn: int | None, global_batch: int) -> list[Figure]:
    from ..ledger.hardware import PRESETS
    from ..ledger.traffic import micro_batch_size
    from . import overview

    m, par = res.model, res.par
    hw = PRESETS[hw_name]
    iron = overview.iron_data(m, par, hw_name, global_batch, gpn)
    mem = memory_data(m, par, micro_batch_size(par, global_batch), hw.memory * 0.9)
    figs = [Figure("layout-memory", f"Memory per rank: {m.name} {par.describe()} on {hw_name}",
                   "layout", "ledger", "fived.ledger.memory.rank_memory of each pipeline rank "
                   "(fused GPU kernels), stacked by category", mem, draw_memory,
                   size=(9.0, 3.6))]
    if par.pp > 1:
        sd = schedule_data(par)
        figs.append(Figure("layout-schedule", f"The schedule: {par.schedule}, pp {par.pp}, "
                           f"{par.micro_batches} micro-batches", "layout", "schedule",
                           "fived.parallel.pipeline.schedules.simulate of the executor's "
                           "action lists (forward 1, backward 2)", sd, draw_schedule,
                           size=(9.0, 0.5 * par.pp + 1.6)))
    figs.append(Figure("layout-iron", f"Traffic per group: {m.name} {par.describe()} on "
                       f"{hw_name}", "layout", "ledger", "fived.ledger.planner.predict: every "
                       "collective's bytes and its link time", iron, overview.draw_iron,
                       size=(9.0, 3.6)))
    return figs


def summary(res: Any, hw_name: str, gpn: int | None, global_batch: int) -> dict[str, Any]:
    """The page's head: what the ledger says of this layout, and its sentences of advice."""
    from ..ledger.hardware import PRESETS
    from ..ledger.memory import FUSED
    from ..ui.ledger_view import advice, ledger_document

    m, par = res.model, res.par
    hw = PRESETS[hw_name]
    g = gpn or hw.gpus_per_node
    doc = ledger_document(m, par, hw, global_batch, g, None, 0.9, FUSED, 1e12,
                          res.train.optimizer)
    args = Namespace(gpus=par.world_size, gpu=hw_name, gpus_per_node=gpn,
                     global_batch_tokens=None)
    adv = advice(doc, args, res, par, par.world_size, global_batch, "", False)
    tm = doc["time"]
    parts = sorted(((k, v) for k, v in tm["components"].items() if v > 0), key=lambda kv: -kv[1])
    return {"fits": doc["fits"], "peak": doc["memory"]["peak"], "usable": doc["usable_memory"],
            "peak_rank": doc["memory"]["pp_rank"], "step": tm["step_seconds"], "mfu": tm["mfu"],
            "bubble": tm["bubble_fraction"], "tokens_per_s": tm["tokens_per_s"],
            "where": [(TIME_NAMES.get(k, k), v / tm["step_seconds"]) for k, v in parts[:4]],
            "change": adv["change"], "plan": adv["plan"], "world": par.world_size,
            "hardware": hw_name, "global_batch": global_batch, "seq_len": m.seq_len,
            "traffic": doc["traffic"]}


def summary_html(s: dict[str, Any], res: Any) -> str:
    from ..ui.report import fmt_n, fmt_s

    par = res.par
    verdict = ('<span class="ok">fits</span>' if s["fits"] else
               '<span class="bad">does not fit</span>')
    where = ", ".join(f"{html.escape(k)} {v:.0%}" for k, v in s["where"])
    change = s["change"] or [f"nothing: it fits and its bubble is {s['bubble']:.0%} of the step"]
    items = "".join(f"<li>{html.escape(c)}</li>" for c in change)
    plan = (f'<p>To search every layout: <code>{html.escape(s["plan"])}</code></p>'
            if s["plan"] and s["change"] else "")
    return (f'<section class="summary"><h2 id="summary">Summary</h2><dl>'
            f"<dt>layout</dt><dd>{html.escape(res.model.name)} on {html.escape(par.describe())}"
            f" · {s['world']}× {html.escape(s['hardware'])} · global batch "
            f"{s['global_batch']} × {s['seq_len']} tokens</dd>"
            f"<dt>memory</dt><dd>{verdict}: the step peaks at {_gb(s['peak'])} per rank "
            f"(pp rank {s['peak_rank']}) of {_gb(s['usable'])} usable</dd>"
            f"<dt>step</dt><dd>{fmt_s(s['step'])} · {fmt_n(s['tokens_per_s'])} tokens/s · MFU "
            f"{s['mfu']:.1%} (predicted, roofline clock)</dd>"
            f"<dt>where time goes</dt><dd>{where}</dd>"
            f"<dt>what to change</dt><dd><ul>{items}</ul></dd></dl>{plan}</section>\n")


def grid_html(par: Any, gpn: int) -> str:
    """Every rank's coordinates, one row per node: what the grid figure drew, as text."""
    from ..ranks.grid import Grid

    g = Grid.from_config(par)
    dims = [d for d in par.order if par.degree(d) > 1]
    rows = []
    for node in range(-(-g.world_size // gpn)):
        cells = []
        for r in range(node * gpn, min(g.world_size, (node + 1) * gpn)):
            c = g.coords(r)
            coord = " ".join(f"{d}{c[d]}" for d in dims) or "-"
            cells.append(f"<td><b>{r}</b><br><small>{coord}</small></td>")
        rows.append(f"<tr><th>node {node}</th>{''.join(cells)}</tr>")
    groups = "".join(
        f"<li><b>{d}</b> ({par.degree(d)}): "
        + "; ".join("{" + ", ".join(map(str, mem)) + "}" for mem in g.partition((d,))[:8])
        + (" …" if len(g.partition((d,))) > 8 else "")
        + (" — crosses nodes" if g.crosses_node((d,), gpn) else " — inside a node")
        + "</li>" for d in dims)
    return (f'<h3 id="layout-grid">The grid: ranks by node ({gpn} GPUs per node), each with '
            f"its coordinates</h3>\n<table class='grid'>{''.join(rows[:16])}</table>"
            + (f"<p class='meta'>(first 16 of {len(rows)} nodes)</p>" if len(rows) > 16 else "")
            + f"<ul class='groups'>{groups}</ul>\n")


def traffic_html(s: dict[str, Any]) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(c['group'])}</td><td>{html.escape(c['op'])}</td>"
        f"<td>{html.escape(c['what'])}</td><td class='n'>{c['count']}</td>"
        f"<td class='n'>{_gb(c['bytes'])}</td><td>{html.escape(c['link'])}</td>"
        f"<td class='n'>{c['seconds'] * 1e3:.2f} ms</td></tr>" for c in s["traffic"]["collectives"])
    total = "".join(f"<tr><th>{html.escape(g)}</th><td colspan=3>total</td><td class='n'>"
                    f"{_gb(v)}</td><td colspan=2></td></tr>"
                    for g, v in s["traffic"]["bytes_by_group"].items())
    return ("<h3 id='layout-traffic'>Traffic per group, one step (pipeline rank "
            f"{s['traffic']['pp_rank']}: the bytes it sends)</h3>\n<table><tr><th>group</th>"
            "<th>collective</th><th>what</th><th>calls</th><th>bytes</th><th>link</th>"
            f"<th>time</th></tr>{rows}{total}</table>\n")


def alternatives(res: Any, hw_name: str, gpn: int | None, global_batch: int,
                 top: int = 5) -> tuple[list[Any], dict[str, int], int | None]:
    """The planner's best layouts for the same model, GPUs and batch, and this layout's place
    among those that fit (None: it does not fit; 0: after the ``top``)."""
    from ..ledger import planner
    from ..ledger.hardware import PRESETS

    m, par = res.model, res.par
    hw = PRESETS[hw_name]
    out = planner.plan(m, par.world_size, hw, global_batch, gpn, top=top,
                       precision=par.precision if par.precision != "auto" else "bf16")
    mine = planner.predict(m, par, hw, global_batch, gpn)
    # its place among those that fit: exact up to the top-th (every faster layout is timed
    # there: planner._cost), else only "after the top"
    place: int | None = None
    if mine.fits:
        place = sum(1 for p in out.ranked if p.step_seconds < mine.step_seconds) + 1
        if len(out.ranked) >= top and mine.step_seconds > out.ranked[top - 1].step_seconds:
            place = 0
    return out.ranked[:top], out.counts, place


def alternatives_html(ranked: list[Any], counts: dict[str, int], place: int | None,
                      res: Any) -> str:
    from ..ui.report import fmt_n, fmt_s

    rows = "".join(
        f"<tr><td class='n'>{i}</td><td>{html.escape(p.name())}</td><td class='n'>"
        f"{_gb(p.memory.peak)}</td><td class='n'>{fmt_s(p.step_seconds)}</td><td class='n'>"
        f"{fmt_n(p.tokens_per_s)}</td><td class='n'>{p.mfu:.1%}</td></tr>"
        for i, p in enumerate(ranked, 1))
    where = (f"This layout would be number {place} of the {counts.get('fit', 0)} that fit."
             if place else f"This layout fits but is slower than these {len(ranked)}."
             if place == 0 else "This layout does not fit; the ones below do.")
    return ("<h3 id='layout-alternatives'>The planner's alternatives (same model, GPUs and "
            f"batch)</h3>\n<p>{where} The planner considered {counts.get('evaluated', 0)} "
            f"layouts of {html.escape(res.model.name)} on {res.par.world_size} GPUs.</p>"
            "<table><tr><th>#</th><th>layout</th><th>memory per rank</th><th>step</th>"
            f"<th>tokens/s</th><th>MFU</th></tr>{rows}</table>\n")
