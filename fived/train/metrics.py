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
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=train.steps, loss="-", tps="-", mfu="-")
        self.first_loss: float | None = None

    def update(self, rec: dict[str, Any]) -> None:
        if self.first_loss is None:
            self.first_loss = rec["loss"]
        self.progress.update(
            self.task, advance=1, loss=f"{rec['loss']:.4f}", tps=f"{rec['tokens_per_s']:.0f}",
            mfu=f"{100 * rec['mfu']:.1f}%",
        )
        if rec.get("skipped"):
            self.progress.console.print(f"step {rec['step']}: overflow, step skipped")

    def close(self) -> None:
        self.progress.stop()

    def final_table(self, history: list[dict[str, Any]]) -> None:
        if not history:
            return
        self.console.print(summary_table(history))


def summary_table(history: list[dict[str, Any]]) -> Table:
    """Median over the steps after the first (warm-up) of what the run measured."""
    steady = history[1:] or history
    t = Table(title="fived train — measured", show_header=True, header_style="bold")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_row("loss first → last", f"{history[0]['loss']:.4f} → {history[-1]['loss']:.4f}")
    t.add_row("tokens/s (median)", f"{statistics.median(h['tokens_per_s'] for h in steady):.0f}")
    t.add_row("MFU (median)", f"{100 * statistics.median(h['mfu'] for h in steady):.2f}%")
    t.add_row("step time (median)", f"{1000 * statistics.median(h['seconds'] for h in steady):.1f} ms")
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
    per_dim: dict[str, float] = {}
    for rank_traffic in history[-1]["traffic_per_rank"]:
        for dim, b in rank_traffic["bytes"].items():
            per_dim[dim] = max(per_dim.get(dim, 0.0), b)
    for dim, b in sorted(per_dim.items()):
        if dim != "metrics":
            t.add_row(f"sent per step, {dim} (max rank)", human_bytes(b))
    return t
