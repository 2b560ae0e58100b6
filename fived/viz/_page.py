"""``fived report``: one self-contained HTML page of figures and the numbers behind them.

    fived report --out DIR                       # the whole series: runs `fived figures all`
    fived report --out DIR --quick               #   ... at the tiny sizes (minutes)
    fived report --out DIR --from FIGDIR         # a page from an existing `figures all` folder
    fived report --out DIR --model llama3-70b --tp 8 --pp 4 --dp 8 --gpus-per-node 8
                                                 # one layout: its grid and iron rule (ledger)
    fived report --out DIR --tp 2 --dp 2 --measure
                                                 # ... and a 2-step run of it on local ranks:
                                                 # every rank's bytes measured beside the ledger

The page (``DIR/index.html``) opens offline: every figure is embedded as a PNG data URI, and under
each one are its source (ledger or run), how it was made, the command that makes it again, a
table of the numbers it plots and the full JSON record (folded). Nothing is fetched: no scripts,
no fonts, no style sheets from elsewhere.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import html
import json
import os
import platform
import sys
import time
from typing import Any

from ..ui import flags
from ..ui.args import Parser
from ._fig import PARTS, Figure, save

PART_TITLES = {
    "overview": "Overview: the ledger, the walls, the map, the grid, the iron rule",
    "collectives": "Part 1 — collectives", "ddp": "Part 2 — DP → DDP", "zero": "Part 3 — ZeRO",
    "fsdp": "Part 4 — FSDP1 vs FSDP2", "tensor": "Part 5 — Megatron's two cuts",
    "context": "Part 6 — sequence and context parallelism", "bubbles": "Part 7 — bubbles",
    "numerics": "Part 8 — numerics: what bf16 and fp16 lose, what stays fp32",
    "optimizers": "Part 9 — optimizers in a sharded world",
    "memory": "Part 10 — memory: one step's live bytes, the ledger beside the dry run",
    "layout": "One layout",
}
CSS = """body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{border-bottom:1px solid #ccc;margin-top:2em}h3{font-size:1.05em}
img{max-width:100%;border:1px solid #eee}figure{margin:0}
table{border-collapse:collapse;font-size:.8em;margin:.5em 0}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}code{background:#f4f4f4;padding:1px 3px}
.meta{font-size:.85em;color:#444}details{font-size:.8em}pre{white-space:pre-wrap;max-height:30em;
overflow:auto;background:#f8f8f8;padding:.5em}"""


def leaves(data: Any, prefix: str = "", limit: int = 60) -> list[tuple[str, Any]]:
    """The scalar values of ``data`` as (path, value), depth first, at most ``limit``."""
    out: list[tuple[str, Any]] = []

    def walk(x: Any, path: str) -> None:
        if len(out) >= limit:
            return
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(x, list) and x and all(not isinstance(v, (dict, list)) for v in x):
            out.append((path, ", ".join(_num(v) for v in x[:16]) + (" …" if len(x) > 16 else "")))
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")
        else:
            out.append((path, _num(x)))

    walk(data, prefix)
    return out


def _num(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def figure_html(rec: dict[str, Any], folder: str) -> str:
    with open(os.path.join(folder, rec["name"] + ".png"), "rb") as fh:
        png = base64.b64encode(fh.read()).decode()
    rows = leaves(rec["data"])
    table = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>"
                    for k, v in rows)
    raw = html.escape(json.dumps(rec, indent=1, default=float))
    summary = ""
    if rec.get("table"):  # the module's own summary rows (header first)
        head, *body = rec["table"]
        summary = ("<table><tr>" + "".join(f"<th>{html.escape(str(c))}</th>" for c in head)
                   + "</tr>" + "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>"
                                                         for c in r) + "</tr>" for r in body)
                   + "</table>\n")
    return (f'<h3 id="{rec["name"]}">{html.escape(rec["title"])}</h3>\n'
            f'<figure><img alt="{html.escape(rec["title"])}" src="data:image/png;base64,{png}">'
            f'\n<figcaption class="meta"><b>source</b>: {html.escape(rec["source"])} · '
            f'<b>how</b>: {html.escape(rec["how"])}<br><b>make it again</b>: <code>'
            f'{html.escape(rec["command"])}</code></figcaption></figure>\n{summary}'
            f"<details><summary>the numbers ({len(rows)} shown; the full record below)"
            f"</summary><table><tr><th>number</th><th>value</th></tr>{table}</table>"
            f"<pre>{raw}</pre></details>\n")


def page(recs: list[dict[str, Any]], folder: str, title: str, meta: dict[str, Any]) -> str:
    parts: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        parts.setdefault(r["part"], []).append(r)
    toc = "".join(f'<li><a href="#part-{p}">{html.escape(PART_TITLES.get(p, p))}</a> ('
                  f"{len(rs)})</li>" for p, rs in parts.items())
    body = []
    for p, rs in parts.items():
        body.append(f'<h2 id="part-{p}">{html.escape(PART_TITLES.get(p, p))}</h2>')
        body += [figure_html(r, folder) for r in rs]
    m = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(_num(v))}</td></tr>"
                for k, v in meta.items())
    return (f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{CSS}</style></head><body>\n<h1>{html.escape(title)}</h1>\n"
            f"<p>Every figure below was drawn from numbers fived measured on this machine or "
            f"computed with its ledger; none was typed in. Each says which, how, and the command "
            f"that makes it again.</p><table>{m}</table><ul>{toc}</ul>\n"
            + "\n".join(body) + "\n</body></html>\n")


def layout_figures(res: Any, hw: str, gpn: int | None, global_batch: int) -> list[Figure]:
    from ..ledger.memory import rank_memory
    from ..ledger.traffic import micro_batch_size
    from . import overview

    par = res.par
    grid = overview.grid_data(par, gpn or min(par.world_size, 8))
    iron = overview.iron_data(res.model, par, hw, global_batch, gpn)
    mem = rank_memory(res.model, par, micro_batch_size(par, global_batch)).as_dict()
    iron["memory_rank0"] = mem
    return [
        Figure("layout-grid", f"The grid of {par.describe()}", "layout", "ledger",
               "fived.ranks.grid.Grid.partition per dimension (what `fived grid` prints)", grid,
               overview.draw_grid, size=(9.0, 2.8)),
        Figure("layout-iron", f"{res.model.name} {par.describe()} on {hw}: bytes and link time "
               "per dimension", "layout", "ledger", "fived.ledger.planner.predict; memory from "
               "fived.ledger.memory.rank_memory (pipeline rank 0)", iron, overview.draw_iron,
               size=(9.0, 3.6)),
    ]


def layout_measured(res: Any) -> Figure:
    """A two-step run of the layout on local gloo ranks; every rank's model-state bytes and
    bytes sent per group, beside ``fived.ledger.verify.predict_rank`` (``fived ledger --check``)."""
    from dataclasses import replace as _replace

    from ..ledger.verify import predict_rank
    from ._runs import train_many

    m, par, train = res.model, res.par, _replace(res.train, steps=2, metrics_out="")
    run = train_many([(m, par, train)])[0]
    keys = ("params", "grads", "master", "optimizer")
    ranks = []
    for r in range(par.world_size):
        mem_l, traf_l = predict_rank(m, par, train.global_batch, r)
        ranks.append({"rank": r,
                      "measured_states": sum(run["memory_per_rank"][r][k] for k in keys),
                      "ledger_states": sum(mem_l[k] for k in keys),
                      "measured_traffic": run["traffic_per_rank"][r]["bytes"],
                      "ledger_traffic": {k: v for k, v in traf_l.items() if v}})
    data = {"model": m.name, "layout": par.describe(), "global_batch": train.global_batch,
            "step_s": run["seconds"], "losses": run["losses"], "ranks": ranks,
            "note": "MoE all-to-all bytes follow the router; the ledger here assumes uniform "
                    "routing" if m.is_moe else ""}
    return Figure("layout-measured", f"{m.name} on {par.describe()}: every rank measured vs "
                  "the ledger", "layout", "ledger+run", "a 2-step fived train of the layout on "
                  "local gloo ranks (last step) beside fived.ledger.verify.predict_rank", data,
                  draw_measured, size=(9.0, 3.6))


def draw_measured(d: dict[str, Any], f: Any) -> None:
    from ._fig import COLORS

    a1, a2 = f.subplots(1, 2)
    rs = d["ranks"]
    xs = [r["rank"] for r in rs]
    a1.bar(xs, [r["measured_states"] / 1e6 for r in rs], color=COLORS[0], label="measured")
    a1.scatter(xs, [r["ledger_states"] / 1e6 for r in rs], marker="_", s=200, color="black",
               zorder=3, label="ledger")
    a1.set(xlabel="rank", ylabel="model-state MB", title="memory per rank")
    a1.legend(fontsize=6)
    groups = sorted({g for r in rs for g in r["measured_traffic"]} - {"metrics"})
    bottom = [0.0] * len(rs)
    for i, g in enumerate(groups):
        v = [r["measured_traffic"].get(g, 0.0) / 1e6 for r in rs]
        a2.bar(xs, v, bottom=bottom, color=COLORS[i % len(COLORS)], label=g)
        bottom = [b + x for b, x in zip(bottom, v)]
    a2.scatter(xs, [sum(r["ledger_traffic"].values()) / 1e6 for r in rs], marker="_", s=200,
               color="black", zorder=3, label="ledger total")
    a2.set(xlabel="rank", ylabel="MB sent in the step", title="traffic per rank by group")
    a2.legend(fontsize=6)


def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="fived report", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="report", metavar="DIR",
                    help="folder for index.html and the figure files (default ./report)")
    ap.add_argument("--from", dest="src", default=None, metavar="FIGDIR",
                    help="build the page from an existing `fived figures all --out FIGDIR`")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (with no --from)")
    ap.add_argument("--parts", default="", help=f"comma list, a subset of {','.join(PARTS)}")
    ap.add_argument("--hardware", default="h100-sxm",
                    help="a fived.ledger.hardware preset for the layout page (default h100-sxm)")
    ap.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                    help="devices per node for the layout page (default: the hardware's)")
    ap.add_argument("--measure", action="store_true",
                    help="layout page: also run it for 2 steps on pp·dp·ep·cp·tp local ranks and "
                         "show every rank's bytes beside the ledger (small models only)")
    flags.add_config_flags(ap, groups=("model", "layout", "run"),
                           only=("model", "tp", "cp", "ep", "dp", "pp", "zero", "precision",
                                 "sequence_parallel", "micro_batches", "global_batch",
                                 "grad_reduce_dtype", "schedule", "virtual_stages"))
    return ap


def main(argv: list[str] | None = None) -> int:
    from ..config import ConfigError, check_values, validate
    from ..ledger.hardware import PRESETS as HW
    from .all import parse_parts, run_all

    a = parser().parse_args(sys.argv[1:] if argv is None else argv)
    res = flags.configs(a)
    if a.print_config:
        return flags.print_config(res, "fived report: the layout page's configuration")
    layout = any(k.startswith("parallel.") or k == "model.name" for k in res.given)
    if a.hardware not in HW:
        raise ConfigError([f"--hardware: unknown {a.hardware!r}; choose from {', '.join(HW)}"])
    parts = parse_parts(a.parts)
    t0 = time.perf_counter()
    meta: dict[str, Any] = {"made": datetime.datetime.now(datetime.UTC)
                            .strftime("%Y-%m-%d %H:%M UTC"), "host": platform.node(),
                            "cpus": os.cpu_count()}
    if layout:
        problems = check_values(res.model, res.par, None)
        if problems:
            raise ConfigError(problems)
        validate(res.model, res.par, res.train)
        os.makedirs(a.out, exist_ok=True)
        print(f"fived report: layout {res.par.describe()} of {res.model.name} → {a.out}/",
              flush=True)
        folder = a.out
        cmd = "fived report " + " ".join(argv if argv is not None else sys.argv[1:])
        figs = layout_figures(res, a.hardware, a.gpus_per_node, res.train.global_batch)
        if a.measure:
            print(f"running {res.par.world_size} local rank(s) for 2 steps ...", flush=True)
            figs.append(layout_measured(res))
        recs = [save(f, folder, cmd) for f in figs]
        title = f"fived: {res.model.name} on {res.par.describe()}"
        meta["command"] = cmd
    else:
        if a.src:
            folder = a.src
            with open(os.path.join(folder, "index.json")) as fh:
                index = json.load(fh)
            print(f"fived report: page from {folder}/index.json → {a.out}/", flush=True)
        else:
            folder = os.path.join(a.out, "figures")
            print(f"fived report: running every part → {folder}/" + (" (quick)" if a.quick
                                                                     else ""), flush=True)
            index = run_all(folder, a.quick, parts)
        recs = [r for r in index["figures"] if r["part"] in parts]
        title = "fived: the series, generated"
        meta.update({"figures made by": index["command"],
                     "seconds": round(index["total_seconds"], 1),
                     "load (1 min) at start": index.get("loadavg_1m_at_start")})
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "index.html")
    with open(path, "w") as fh:
        fh.write(page(recs, folder, title, meta))
    print(f"{'figure':<30} source")
    for r in recs:
        print(f"{r['name']:<30} {r['source']}")
    print(f"wrote {path} ({os.path.getsize(path) / 1e6:.1f} MB, {len(recs)} figures, "
          f"self-contained) in {time.perf_counter() - t0:.0f} s")
    return 0
