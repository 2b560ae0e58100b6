"""Gantt chart of a pipeline schedule: the same action lists the executor runs.

``fived figures schedule --schedule 1f1b --pp 4 --micro-batches 8 [--virtual-stages 2]
[--out schedule.png]`` simulates the lists with unit forward and 2-unit backward (F = B = W = 1
for the split schedules ZB-H1, ZB-V and DualPipe-V, per chunk), draws one row per rank (the
second chunk of a rank lighter: for ZB-V / DualPipe-V the way back up the V) and prints the
idle-slot bubble next to the formula.
"""

from __future__ import annotations

import argparse

from .. import schedules
from ..config import ModelConfig, ParallelConfig, validate
from ..ui import flags
from ..ui.args import Parser

COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868"}


def draw(sched: schedules.Schedule, out: str) -> schedules.Timeline:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = schedules.simulate(sched)
    fig, ax = plt.subplots(figsize=(max(6.0, t.makespan * 0.35), 0.6 * sched.pp + 1.2))
    draw_on(ax, sched, t)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return t


def draw_on(ax, sched: schedules.Schedule, t: schedules.Timeline) -> None:
    """One row per rank of ``t`` (``schedules.simulate(sched)``) on the axes ``ax``."""
    import matplotlib.pyplot as plt

    for r, spans in enumerate(t.spans):
        for a, start, end in spans:
            if a.kind not in COLORS:
                continue
            chunk = a.stage // sched.pp  # 0 down the V (or the first loop), 1 back up
            ax.barh(r, end - start, left=start, color=COLORS[a.kind], edgecolor="black",
                    alpha=1.0 - 0.35 * chunk)
            ax.text((start + end) / 2, r, str(a.mb), ha="center", va="center", fontsize=7,
                    color="white")
    ax.set_yticks(range(sched.pp), [f"rank {r}" for r in range(sched.pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time (forward = 1)")
    ax.set_title(f"{sched.name}: p={sched.pp}, m={sched.micro_batches}"
                 + (f", v={sched.virtual}" if sched.virtual > 1 else "")
                 + f" — bubble {t.bubble_fraction():.1%}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for k, c in COLORS.items()
               if k != "W" or sched.split_backward]
    ax.legend(handles, [k for k in COLORS if k != "W" or sched.split_backward], loc="upper right",
              fontsize=7)


def out_path(out: str, name: str) -> str:
    """--out: a file (.png, .svg, .pdf) as given, else a folder (made if missing, its parent
    must exist) with ``name`` in it; "" is ``name`` here. A ConfigError before anything is
    drawn."""
    from pathlib import Path

    from ..config import ConfigError

    if not out:
        return name
    path = Path(out)
    if path.suffix.lower() in (".png", ".svg", ".pdf") and not path.is_dir():
        folder = path.parent
    else:
        folder, path = path, path / name
    if folder.exists() and not folder.is_dir():
        raise ConfigError([f"--out {out}: {str(folder)!r} is a file, not a folder"])
    if not folder.parent.is_dir():
        raise ConfigError([f"--out {out}: the folder {str(folder.parent)!r} does not exist"])
    folder.mkdir(exist_ok=True)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="fived figures schedule", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_flag(ap, "schedule", default="1f1b",
                   help=f"the schedule to draw ({', '.join(schedules.NAMES)})")
    flags.add_flag(ap, "pp", default=4, help="pipeline ranks (one row each)")
    flags.add_flag(ap, "micro_batches", default=8, help="micro-batches per step")
    flags.add_flag(ap, "virtual_stages", default=2,
                   help="model chunks per rank (--schedule interleaved; zb-v and dualpipe-v "
                   "always run 2)")
    ap.add_argument("--out", default="", metavar="FILE.png|DIR",
                    help="where to write the figure: a .png/.svg file, or a folder to write "
                    "schedule-NAME-pP-mM.png into (default: that name, here)")
    a = flags.parse(ap, argv)
    v = a.virtual_stages if a.schedule == "interleaved" else 2 if a.schedule in schedules.V_SHAPED else 1
    # what the schedule needs, worded as `fived train` words it (ConfigError: exit 2)
    validate(ModelConfig(layers=a.pp * v), ParallelConfig(
        pp=a.pp, schedule=a.schedule, virtual_stages=v, micro_batches=a.micro_batches))
    sched = schedules.build(a.schedule, a.pp, a.micro_batches, v)
    schedules.check(sched)
    out = out_path(a.out, f"schedule-{a.schedule}-p{a.pp}-m{a.micro_batches}.png")
    t = draw(sched, out)
    print(f"{a.schedule}: p={a.pp} m={a.micro_batches} v={v}: idle slots {sum(t.idle):g} of "
          f"{a.pp * t.makespan:g} → bubble {t.bubble_fraction():.4f} "
          f"(formula {schedules.bubble_formula(a.schedule, a.pp, a.micro_batches, v):.4f}); "
          f"peak live micro-batches per rank {schedules.peak_live_rank(sched)}")
    print(f"figure: {out}")
    return 0
