"""Every figure of the series: the overview and parts 1–10, in reading order, with a progress bar.

``fived figures all --out DIR [--quick] [--parts overview,zero,...]`` runs each part's module
(``fived figures PART`` does one) and writes, besides each figure's PNG, SVG and JSON,
``DIR/index.json``: the list of figure records in order, the seconds each part took and the
machine's load when it started. ``fived report --from DIR`` turns that folder into one page.

Sizes are chosen so that the full run finishes within 10 minutes on an unloaded 2-core machine;
``--quick`` (tiny sizes, one repetition) takes a few minutes even when the machine is shared.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

from ..ui.args import Parser
from ._fig import PARTS, add_args, progress, run_part, summary


def run_all(out: str, quick: bool, parts: list[str], show: bool = True) -> dict:
    """Run every part; a part that fails is reported in ``index["failed"]`` and the others still
    run. ``OUT/index.json`` is rewritten after each part."""
    import traceback

    recs, seconds, failed = [], {}, {}
    t0 = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    os.makedirs(out, exist_ok=True)

    def write() -> dict:
        index = {"schema": "fived.viz.index/1", "quick": quick, "parts": parts,
                 "seconds": seconds, "total_seconds": time.perf_counter() - t0,
                 "loadavg_1m_at_start": load, "cpus": os.cpu_count(),
                 "command": f"fived figures all --out {out}" + (" --quick" if quick else "")
                 + ("" if parts == list(PARTS) else f" --parts {','.join(parts)}"),
                 "failed": failed, "figures": recs}
        with open(os.path.join(out, "index.json"), "w") as fh:
            json.dump(index, fh, indent=1, default=float)
        return index

    with progress(len(parts)) as bar:
        task = bar.add_task("starting", total=len(parts))

        def tick(text: str) -> None:
            bar.update(task, description=text)
            if show and not bar.console.is_terminal:
                bar.console.print(f"  [{time.perf_counter() - t0:5.0f} s] {text}")

        for part in parts:
            t = time.perf_counter()
            try:
                mod = importlib.import_module(f"fived.viz.{part}")
                recs += run_part(part, mod.figures, out, quick, tick)
            except Exception as e:  # noqa: BLE001 — report it, run the other parts
                failed[part] = f"{type(e).__name__}: {e}"
                bar.console.print(f"[red]{part} failed[/]: {failed[part]}\n"
                                  + traceback.format_exc(limit=3))
            seconds[part] = time.perf_counter() - t
            bar.update(task, advance=1)
            write()
    return write()


def parse_parts(text: str) -> list[str]:
    from ..config import ConfigError

    parts = [p.strip() for p in text.split(",") if p.strip()] if text else list(PARTS)
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise ConfigError([f"--parts: unknown {', '.join(bad)}; choose from {', '.join(PARTS)}"])
    return parts


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="fived figures all", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    ap.add_argument("--parts", default="", help=f"comma list, a subset of {','.join(PARTS)}")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    parts = parse_parts(a.parts)
    print(f"fived figures all: {len(parts)} part(s) → {a.out}/" + (" (quick)" if a.quick else ""),
          flush=True)
    index = run_all(a.out, a.quick, parts)
    summary(index["figures"], a.out, index["total_seconds"])
    print("seconds per part: " + ", ".join(f"{k} {v:.0f}" for k, v in index["seconds"].items()))
    if index["failed"]:
        print(f"FAILED: {', '.join(index['failed'])} (see above)", file=sys.stderr)
        return 1
    return 0
