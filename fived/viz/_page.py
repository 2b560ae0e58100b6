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
CSS = """
:root{--ink:#1f2328;--muted:#57606a;--line:#d0d7de;--soft:#f6f8fa;--accent:#0a5bd8}
body{font:16px/1.55 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;
color:var(--ink);max-width:940px;margin:2.5em auto;padding:0 20px}
h1{font-size:1.9em;line-height:1.2;margin:0 0 .3em}
h2{font-size:1.4em;margin:2.2em 0 .6em;padding-bottom:.25em;border-bottom:2px solid var(--line)}
h3{font-size:1.1em;margin:2em 0 .5em}
p{margin:.6em 0}a{color:var(--accent);text-decoration:none}a:hover{text-decoration:underline}
figure{margin:.5em 0 .8em}
figure img{display:block;width:100%;max-width:900px;height:auto;border:1px solid var(--line);
border-radius:4px}
figcaption,.meta{font-size:.85em;color:var(--muted);margin-top:.4em}
table{border-collapse:collapse;font-size:.88em;margin:.6em 0 1em;font-variant-numeric:tabular-nums}
th,td{border-bottom:1px solid var(--line);padding:4px 10px;text-align:left;vertical-align:top}
th{background:var(--soft);font-weight:600}td.n{text-align:right;white-space:nowrap}
code{font:.88em ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;background:var(--soft);
padding:1px 4px;border-radius:3px}
details{font-size:.85em;margin:.3em 0 1em}summary{cursor:pointer;color:var(--muted)}
pre{white-space:pre-wrap;max-height:30em;overflow:auto;background:var(--soft);padding:.6em;
font-size:.85em}
.summary{background:var(--soft);border:1px solid var(--line);border-left:4px solid var(--accent);
border-radius:4px;padding:.4em 1.2em 1em;margin:1.2em 0 2em}
.summary h2{border:0;margin:.6em 0 .3em;font-size:1.2em}
.summary dl{display:grid;grid-template-columns:11em 1fr;gap:.35em 1em;margin:0}
.summary dt{font-weight:600;color:var(--muted)}.summary dd{margin:0}
.summary ul{margin:0;padding-left:1.2em}
.ok{color:#1a7f37;font-weight:600}.bad{color:#cf222e;font-weight:600}
table.grid td{text-align:center;border:1px solid var(--line);min-width:4.5em}
table.grid small{color:var(--muted)}
ul.toc{columns:2;padding-left:1.2em}ul.groups{font-size:.9em}
"""


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


def _label(path: str) -> str:
    """A record's key as a reader's words: ``step_seconds`` → ``step seconds``."""
    return path.replace("_", " ")


def _top_numbers(data: dict[str, Any]) -> list[tuple[str, str]]:
    """The record's top-level numbers and words (the nested ones stay in the folded record)."""
    return [(_label(k), _num(v)) for k, v in data.items()
            if isinstance(v, (int, float, str)) and not isinstance(v, bool) and v != ""]


def map_table(data: dict[str, Any]) -> str:
    """The 5D map (``overview-map``) as a table: what each dimension cuts, sends and saves."""
    rows = "".join(
        f"<tr><th>{html.escape(dim)}</th><td>{html.escape(r['cuts'])}</td>"
        f"<td>{html.escape(', '.join(r['collectives']) or '-')}</td>"
        f"<td class='n'>×{r['states_ratio']:.3f}</td><td class='n'>×{r['activations_ratio']:.3f}"
        f"</td><td>{html.escape(r['model'])}</td></tr>" for dim, r in data["rows"].items())
    return ("<table><tr><th>dim</th><th>cuts</th><th>collectives (ledger)</th>"
            f"<th>model states per rank</th><th>activations per rank</th><th>model</th></tr>"
            f"{rows}</table><p class='meta'>each dimension at degree {data['degree']}, "
            "per-rank bytes relative to degree 1</p>\n")


#: figures the page shows as HTML instead of their picture
AS_HTML = {"overview-map": map_table}


def figure_html(rec: dict[str, Any], folder: str) -> str:
    caption = (f'<figcaption><b>source</b>: {html.escape(rec["source"])} · '
               f'<b>how</b>: {html.escape(rec["how"])}<br><b>make it again</b>: <code>'
               f'{html.escape(rec["command"])}</code></figcaption>')
    if rec["name"] in AS_HTML:
        body = f"<figure>{AS_HTML[rec['name']](rec['data'])}{caption}</figure>\n"
    else:
        with open(os.path.join(folder, rec["name"] + ".png"), "rb") as fh:
            png = base64.b64encode(fh.read()).decode()
        body = (f'<figure><img alt="{html.escape(rec["title"])}" '
                f'src="data:image/png;base64,{png}">\n{caption}</figure>\n')
    rows = _top_numbers(rec["data"])
    table = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>"
                    for k, v in rows)
    raw = html.escape(json.dumps(rec, indent=1, default=float))
    summary = ""
    if rec.get("table"):  # the module's own summary rows (header first)
        head, *rest = rec["table"]
        summary = ("<table><tr>" + "".join(f"<th>{html.escape(str(c))}</th>" for c in head)
                   + "</tr>" + "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>"
                                                         for c in r) + "</tr>" for r in rest)
                   + "</table>\n")
    numbers = (f"<table><tr><th>number</th><th>value</th></tr>{table}</table>" if rows else "")
    return (f'<h3 id="{rec["name"]}">{html.escape(rec["title"])}</h3>\n{body}{summary}'
            f"<details><summary>the numbers behind it (the record, as the JSON file holds it)"
            f"</summary>{numbers}<pre>{raw}</pre></details>\n")


def series_summary(recs: list[dict[str, Any]], parts: dict[str, list[dict[str, Any]]]) -> str:
    """The series page's head: what is on it and where each figure's numbers come from."""
    by: dict[str, int] = {}
    for r in recs:
        by[r["source"]] = by.get(r["source"], 0) + 1
    src = {"ledger": "computed by the ledger", "run": "measured on local gloo ranks",
           "ledger+run": "a run beside the ledger", "schedule": "the executor's schedule lists"}
    items = "".join(f"<li>{n} {html.escape(src.get(k, k))}</li>" for k, n in by.items())
    return (f'<section class="summary"><h2 id="summary">Summary</h2><p>{len(recs)} figures in '
            f"{len(parts)} parts, from the 16Ψ of model states and the two walls through each "
            f"of the five dimensions to numerics and optimizers. Of the figures:</p>"
            f"<ul>{items}</ul><p>None was typed in: each says which source, how it was made "
            "and the command that makes it again; its numbers are folded under it.</p>"
            "</section>\n")


def page(recs: list[dict[str, Any]], folder: str, title: str, meta: dict[str, Any],
         head: str = "", tail: str = "") -> str:
    """The page: ``head`` (a summary) under the title, then each part's figures; ``tail``
    (the layout page's tables) after them."""
    parts: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        parts.setdefault(r["part"], []).append(r)
    toc = "".join(f'<li><a href="#part-{p}">{html.escape(PART_TITLES.get(p, p))}</a> ('
                  f"{len(rs)})</li>" for p, rs in parts.items())
    body = []
    for p, rs in parts.items():
        body.append(f'<h2 id="part-{p}">{html.escape(PART_TITLES.get(p, p))}</h2>')
        body += [figure_html(r, folder) for r in rs]
    m = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_num(v))}</td></tr>"
                for k, v in meta.items())
    head = head or series_summary(recs, parts)
    return (f"<!doctype html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<meta name='viewport' content='width=device-width,initial-scale=1'><title>"
            f"{html.escape(title)}</title><style>{CSS}</style></head><body>\n"
            f"<h1>{html.escape(title)}</h1>\n{head}"
            + (f"<ul class='toc'>{toc}</ul>\n" if len(parts) > 1 else "")
            + "\n".join(body) + tail
            + f"\n<h2 id='made'>How this page was made</h2><table>{m}</table>\n</body></html>\n")


def layout_figures(res: Any, hw: str, gpn: int | None, global_batch: int) -> list[Figure]:
    from . import _layout as layout

    return layout.figures(res, hw, gpn, global_batch)


def layout_page(res: Any, hw: str, gpn: int | None, global_batch: int) -> tuple[str, str]:
    """The layout page's summary (head) and its tables (tail): the grid, the traffic per
    group and the planner's alternatives (``fived.viz._layout``)."""
    from ..ledger.hardware import PRESETS
    from . import _layout as layout

    s = layout.summary(res, hw, gpn, global_batch)
    ranked, counts, place = layout.alternatives(res, hw, gpn, global_batch)
    g = gpn or min(res.par.world_size, PRESETS[hw].gpus_per_node)
    tail = (layout.grid_html(res.par, g) + layout.traffic_html(s)
            + layout.alternatives_html(ranked, counts, place, res))
    return layout.summary_html(s, res), tail


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
    a1.legend()
    groups = sorted({g for r in rs for g in r["measured_traffic"]} - {"metrics"})
    bottom = [0.0] * len(rs)
    for i, g in enumerate(groups):
        v = [r["measured_traffic"].get(g, 0.0) / 1e6 for r in rs]
        a2.bar(xs, v, bottom=bottom, color=COLORS[i % len(COLORS)], label=g)
        bottom = [b + x for b, x in zip(bottom, v)]
    a2.scatter(xs, [sum(r["ledger_traffic"].values()) / 1e6 for r in rs], marker="_", s=200,
               color="black", zorder=3, label="ledger total")
    a2.set(xlabel="rank", ylabel="MB sent in the step", title="traffic per rank by group")
    a2.legend(fontsize=8)


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
    from dataclasses import replace

    from ..config import ConfigError, check_values, resolve_precision, validate
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
        # --precision auto on a GPU preset: bf16, as `fived ledger` and `fived plan` resolve it
        res = replace(res, par=resolve_precision(res.par, True, a.hardware)[0])
        figs = layout_figures(res, a.hardware, a.gpus_per_node, res.train.global_batch)
        if a.measure:
            print(f"running {res.par.world_size} local rank(s) for 2 steps ...", flush=True)
            figs.append(layout_measured(res))
        recs = [save(f, folder, cmd) for f in figs]
        head, tail = layout_page(res, a.hardware, a.gpus_per_node, res.train.global_batch)
        title = f"fived: {res.model.name} on {res.par.describe()}"
        meta["command"] = cmd
    else:
        head = tail = ""
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
        fh.write(page(recs, folder, title, meta, head, tail))
    print(f"{'figure':<30} source")
    for r in recs:
        print(f"{r['name']:<30} {r['source']}")
    print(f"wrote {path} ({os.path.getsize(path) / 1e6:.1f} MB, {len(recs)} figures, "
          f"self-contained) in {time.perf_counter() - t0:.0f} s")
    return 0
