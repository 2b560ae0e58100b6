"""What every figure module shares: a ``Figure`` is its numbers plus a function that draws them.

``save(fig, out, command)`` writes three files per figure::

    OUT/NAME.png   OUT/NAME.svg   OUT/NAME.json

The JSON holds exactly the numbers the picture plots (``data``), where they came from
(``source``: ``ledger`` = fived.ledger formulas, ``run`` = measured on spawned gloo ranks or
in-process, ``schedule`` = the executor's own action lists), a sentence on how they were made
(``how``) and the command that makes the figure again (``command``). Nothing is typed in: every
module computes ``data`` from the ledger or from a run, and the tests check the JSON against the
ledger or re-derive it from the run's own records.

A figure module (``fived figures NAME``) exposes ``figures(quick, tick) -> list[Figure]``
(``tick(text)`` reports progress) and ``main = part_main(NAME, figures, __doc__)``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..ui.args import Parser

#: the parts of the series, in reading order (module names under fived.viz)
PARTS = ("overview", "collectives", "ddp", "zero", "fsdp", "tensor", "context", "bubbles",
         "numerics", "optimizers", "memory")

COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3",
          "#8C8C8C", "#CCB974", "#64B5CD"]


WIDTH = 9.0  # inches: every figure is drawn this wide, so the page shows them at one width
DPI = 100  # 900 pixels: the report's column


@dataclass
class Figure:
    name: str  # file stem: PART-what
    title: str
    part: str
    source: str  # "ledger" | "run" | "ledger+run" | "schedule"
    how: str
    data: dict[str, Any]
    draw: Callable[[dict[str, Any], Any], None]  # (data, matplotlib Figure)
    size: tuple[float, float] = (WIDTH, 4.0)  # drawn WIDTH wide (height scaled if wider)
    table: list[list[Any]] = field(default_factory=list)  # rows for the report page (header first)


def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    pyplot.rcParams.update({"font.size": 9, "axes.titlesize": 10, "legend.fontsize": 8,
                            "xtick.labelsize": 8, "ytick.labelsize": 8, "legend.framealpha": 0.9,
                            "axes.spines.top": False, "axes.spines.right": False,
                            "svg.hashsalt": "fived", "figure.dpi": 100})
    return pyplot




def legend_below(f: Any, ncol: int = 6, room: float = 0.12) -> None:
    """One legend for every panel, under them, where no bar or tick label can hide it."""
    handles, labels = [], []
    for ax in f.get_axes():
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    f.legend(handles, labels, loc="lower center", ncol=ncol, frameon=False)
    f.fived_rect = (0, room, 1, 1)


def integer_rank_ticks(f: Any) -> None:
    """Axes that count ranks (or micro-batches, or nodes) get whole-number ticks only: no
    rank −0.5."""
    from matplotlib.ticker import MaxNLocator

    for ax in f.get_axes():
        for axis, label in ((ax.xaxis, ax.get_xlabel()), (ax.yaxis, ax.get_ylabel())):
            low = label.lower()
            if any(w in low.split() for w in ("rank", "ranks", "micro-batch", "node", "step")):
                if axis.get_scale() == "linear":
                    axis.set_major_locator(MaxNLocator(integer=True))


def save(fig: Figure, out: str, command: str) -> dict[str, Any]:
    """Draw ``fig`` into OUT/NAME.{png,svg} and write OUT/NAME.json; the JSON record."""
    p = plt()
    os.makedirs(out, exist_ok=True)
    w, h = fig.size
    f = p.figure(figsize=(WIDTH, h if w <= WIDTH else max(2.5, h * WIDTH / w * 1.15)))
    fig.draw(fig.data, f)
    integer_rank_ticks(f)
    f.suptitle(fig.title, fontsize=11)
    # a figure-wide legend below the panels: the draw function leaves room (``legend_below``)
    f.tight_layout(rect=getattr(f, "fived_rect", None))
    base = os.path.join(out, fig.name)
    f.savefig(base + ".png", dpi=DPI)
    f.savefig(base + ".svg", metadata={"Date": None})
    p.close(f)
    rec = {"name": fig.name, "title": fig.title, "part": fig.part, "source": fig.source,
           "how": fig.how, "command": command, "data": fig.data, "table": fig.table,
           "files": [fig.name + ".png", fig.name + ".svg"]}
    with open(base + ".json", "w") as fh:
        json.dump(rec, fh, indent=1, default=float)
    return rec


def command_for(part: str, out: str, quick: bool) -> str:
    return f"fived figures {part} --out {out}" + (" --quick" if quick else "")


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default="figures", metavar="DIR",
                    help="folder for NAME.png, NAME.svg, NAME.json (default ./figures)")
    ap.add_argument("--quick", action="store_true",
                    help="smallest sizes and fewest repetitions (seconds, for tests and CI)")


def run_part(part: str, build: Callable, out: str, quick: bool, tick: Callable[[str], None]
             ) -> list[dict[str, Any]]:
    """Build one part's figures and save them; the JSON records."""
    figs = build(quick, tick)
    recs = []
    for fig in figs:
        tick(f"{part}: drawing {fig.name}")
        recs.append(save(fig, out, command_for(part, out, quick)))
    return recs


def progress(total: int):
    """A rich progress bar (prints one line per advance when the output is not a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    con = Console(stderr=True, highlight=False)
    return Progress(TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=con, transient=con.is_terminal)


def summary(recs: list[dict[str, Any]], out: str, seconds: float) -> None:
    print(f"{'figure':<30} {'source':<11} files")
    for r in recs:
        print(f"{r['name']:<30} {r['source']:<11} {r['name']}.png/.svg/.json")
    print(f"{len(recs)} figure(s) in {out}/ in {seconds:.0f} s")


def part_main(part: str, build: Callable, doc: str | None) -> Callable[[list[str] | None], int]:
    def main(argv: list[str] | None = None) -> int:
        import sys

        ap = Parser(prog=f"fived figures {part}", description=doc,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
        add_args(ap)
        a = ap.parse_args(sys.argv[1:] if argv is None else argv)
        print(f"fived figures {part}: writing to {a.out}/" + (" (quick)" if a.quick else ""),
              flush=True)
        t0 = time.perf_counter()
        with progress(1) as bar:
            task = bar.add_task(part, total=1)

            def tick(text: str) -> None:
                bar.update(task, description=text)
                if not bar.console.is_terminal:
                    bar.console.print(f"  {text}")

            recs = run_part(part, build, a.out, a.quick, tick)
            bar.update(task, advance=1, description=f"{part}: done")
        summary(recs, a.out, time.perf_counter() - t0)
        return 0

    return main
