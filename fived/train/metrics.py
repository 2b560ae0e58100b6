"""What a run shows: a live progress line on rank 0 and the closing table of measurements."""

from __future__ import annotations

import statistics
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


class LiveDisplay:
    def __init__(self, model: Any, par: Any, train: Any, world: int, peak_flops: float):
        self.console = Console(stderr=False)
        self.train = train
        self.progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(bar_width=24),
            TextColumn("loss [cyan]{task.fields[loss]}"),
            TextColumn("tok/s {task.fields[tps]}"),
            TextColumn("MFU {task.fields[mfu]}"),
            *([TextColumn("a2a {task.fields[moe]}")] if getattr(model, "is_moe", False) else []),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=train.steps, loss="-", tps="-", mfu="-",
                                           moe="")
        self.first_loss: float | None = None

    def update(self, rec: dict[str, Any]) -> None:
        if self.first_loss is None:
            self.first_loss = rec["loss"]
        self.progress.update(
            self.task, completed=rec["step"] + 1, loss=f"{rec['loss']:.4f}", tps=f"{rec['tokens_per_s']:.0f}",
            mfu=_mfu(rec["mfu"]),
            moe=f"{100 * rec['moe']['a2a_share']:.0f}%" if rec.get("moe") else "",
        )
        if rec.get("moe"):
            self.progress.console.print(f"step {rec['step']}: {moe_line(rec['moe'])}")
        if rec.get("skipped"):
            self.progress.console.print(f"step {rec['step']}: overflow, step skipped")

    def close(self) -> None:
        self.progress.stop()

    def final_table(self, history: list[dict[str, Any]], totals: Any = None) -> None:
        """``history``: the kept (last) records; ``totals``: ``resilience.History`` (the first
        loss and the run's totals beyond the window)."""
        if not history:
            return
        self.console.print(summary_table(history, totals))


def _mfu(mfu: float, digits: int = 1) -> str:
    return mfu_text(mfu, digits)


MFU_BOUND = 1.0  # a measured MFU above this is not one: the peak was measured on a busier machine


def mfu_text(mfu: float, digits: int = 1) -> str:
    """The MFU as a run shows it: a percentage, or "n/a (loaded)" when it exceeds 100 %."""
    return "n/a (loaded)" if mfu > MFU_BOUND else f"{100 * mfu:.{digits}f}%"


def moe_line(moe: dict[str, Any] | None) -> str:
    """One step's MoE line: aux + z loss, dropped assignments, tokens per expert (summed over
    layers, as % of the routed rows) and the all-to-all's share of step time."""
    if not moe:
        return ""
    per = [sum(col) for col in zip(*moe["tokens_per_expert"])]
    total = max(sum(per), 1)
    spread = "/".join(f"{100 * c / total:.0f}" for c in per)
    return (f"aux {moe['aux_loss']:.4f} z {moe['z_loss']:.4f} drop {moe['dropped']} "
            f"tokens/expert% {spread} a2a {100 * moe['a2a_share']:.0f}% of step")


def summary_table(history: list[dict[str, Any]], totals: Any = None) -> Table:
    """Median over the steps after the first (warm-up) of what the run measured (of the kept
    window of records, ``fived.train.resilience.WINDOW``, on a long run)."""
    steady = history[1:] or history
    first = totals.first["loss"] if totals is not None and totals.first else history[0]["loss"]
    t = Table(title="fived train — measured", show_header=True, header_style="bold")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_row("loss first → last", f"{first:.4f} → {history[-1]['loss']:.4f}")
    t.add_row("tokens/s (median)", f"{statistics.median(h['tokens_per_s'] for h in steady):.0f}")
    mfu = statistics.median(h["mfu"] for h in steady)
    t.add_row("MFU (median)", _mfu(mfu, 2))
    if mfu > 1.0:
        t.add_row("  why n/a", f"measured {100 * mfu:.0f}% > 100%: the matmul peak was measured "
                  "while the machine was busier than during the steps")
    t.add_row("step time (median)", f"{1000 * statistics.median(h['seconds'] for h in steady):.1f} ms")
    if history[-1].get("moe"):
        moe = history[-1]["moe"]
        t.add_row("MoE aux / z loss (last)", f"{moe['aux_loss']:.5f} / {moe['z_loss']:.5f}")
        dropped = (totals.moe_dropped if totals is not None
                   else sum(h["moe"]["dropped"] for h in history))
        t.add_row("MoE dropped assignments (total)", f"{dropped}")
        per = [sum(col) for col in zip(*moe["tokens_per_expert"])]
        t.add_row("MoE tokens per expert (last, all layers)", " ".join(map(str, per)))
        t.add_row("all-to-all share of step (median)",
                  f"{100 * statistics.median(h['moe']['a2a_share'] for h in steady):.1f}%")
    if totals is not None and totals.skipped:
        t.add_row("steps skipped (overflow / non-finite)", f"{totals.skipped} of {totals.steps}")
    mems = history[-1]["memory_per_rank"]
    worst = max(range(len(mems)), key=lambda r: sum(mems[r][k] for k in
                                                    ("params", "grads", "master", "optimizer")))
    m = mems[worst]
    states = m["params"] + m["grads"] + m["master"] + m["optimizer"]
    t.add_row(f"model states, rank {worst} (largest)", human_bytes(states))
    t.add_row("  params / grads / master / optim",
              " / ".join(human_bytes(m[k]) for k in ("params", "grads", "master", "optimizer")))
    if m.get("padding"):
        t.add_row("  ZeRO padding", human_bytes(m["padding"]))
    rss = history[-1].get("rss_per_rank")
    if rss:  # measured (getrusage), not predicted: the build, then the whole run
        t.add_row("build time (max rank)", f"{max(r.get('build_s', 0) for r in rss):.2f} s")
        t.add_row("peak RSS after build (max rank)", human_bytes(max(r["build"] for r in rss)))
        t.add_row("peak RSS, run (max rank)", human_bytes(max(r["peak"] for r in rss)))
    per_dim: dict[str, float] = {}
    for rank_traffic in history[-1]["traffic_per_rank"]:
        for dim, b in rank_traffic["bytes"].items():
            per_dim[dim] = max(per_dim.get(dim, 0.0), b)
    for dim, b in sorted(per_dim.items()):
        if dim != "metrics":
            t.add_row(f"sent per step, {dim} (max rank)", human_bytes(b))
    return t
