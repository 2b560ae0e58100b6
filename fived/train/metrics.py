"""What a run shows: a live progress line on rank 0 and the closing table of measurements."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table


def human_bytes(n: float) -> str:
    """``fived.ledger.memory.fmt_bytes``: binary units, as every command prints bytes."""
    from ..ledger.memory import fmt_bytes

    return fmt_bytes(n)


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
            # multi-token prediction: each module's loss, module 1 first
            *([TextColumn("mtp [cyan]{task.fields[mtp]}")] if getattr(model, "mtp_depth", 0)
              else []),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=train.steps, loss="-", tps="-", mfu="-",
                                           moe="", mtp="-")
        self.first_loss: float | None = None

    def update(self, rec: dict[str, Any]) -> None:
        if self.first_loss is None:
            self.first_loss = rec["loss"]
        self.progress.update(
            self.task, completed=rec["step"] + 1, loss=f"{rec['loss']:.4f}", tps=f"{rec['tokens_per_s']:.0f}",
            mfu=_mfu(rec["mfu"]),
            moe=f"{100 * rec['moe']['a2a_share']:.0f}%" if rec.get("moe") else "",
            mtp="/".join(f"{v:.4f}" for v in rec.get("mtp_losses", [])),
        )
        if rec.get("moe"):
            self.progress.console.print(f"step {rec['step']}: {moe_line(rec['moe'])}")
        if rec.get("loss_by_source"):  # a mixture: the step's loss per source
            by = " · ".join(f"{k} {'-' if v is None else f'{v:.4f}'}"
                            for k, v in rec["loss_by_source"].items())
            self.progress.console.print(f"step {rec['step']}: loss by source {by}")
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
    traced = history[-1].get("memory_trace_per_rank")
    if traced:  # measured live tensor bytes (not the process's RSS), against the ledger's peak
        worst = max(range(len(traced)), key=traced.__getitem__)
        t.add_row(f"peak live tensors, rank {worst} (traced)", human_bytes(traced[worst]))
        ledger_peaks = history[-1].get("ledger_peak_per_rank")
        if ledger_peaks:
            t.add_row("  the ledger's peak (step), that rank", human_bytes(ledger_peaks[worst]))
    per_dim: dict[str, float] = {}
    for rank_traffic in history[-1]["traffic_per_rank"]:
        for dim, b in rank_traffic["bytes"].items():
            per_dim[dim] = max(per_dim.get(dim, 0.0), b)
    for dim, b in sorted(per_dim.items()):
        if dim != "metrics":
            t.add_row(f"sent per step, {dim} (max rank)", human_bytes(b))
    return t


def rss_peak() -> int:
    """This process's peak resident set size in bytes (``getrusage``: VmHWM)."""
    import resource
    import sys

    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kb if sys.platform == "darwin" else kb * 1024)


def measure_matmul_peak(seconds: float = 0.25, n: int = 512,
                        device: Any = "cpu") -> float:
    """FLOP/s of an fp32 n×n matmul on this process's threads, or its cuda device."""
    import torch

    dev = torch.device(device)
    a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    a @ b
    sync()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    sync()
    return 2.0 * n**3 * reps / (time.perf_counter() - t0)


MEASURE_PEAK = -1.0  # train_rank's peak_flops: every rank measures, at once (measure_world_peak)


def measure_world_peak(world: int, device: Any, seconds: float = 0.25) -> float:
    """The MFU denominator: every rank measures its own matmul peak at the same moment (a
    barrier first), on the threads (or device) it trains on, and the peak is their sum. Ranks
    that share a machine share its cores while they measure, exactly as while they train, so
    the sum cannot exceed what the machine gives them (one process measuring for all, with its
    own threads, could: e.g. OMP_NUM_THREADS=1 there, a thread per rank here, or a machine busy
    then and quiet now)."""
    import torch
    import torch.distributed as dist

    if world > 1:
        dist.barrier()
    mine = measure_matmul_peak(seconds, device=device)
    if world == 1:
        return mine
    t = torch.tensor([mine], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t[0])


def mfu_of(flops_per_token: float, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOPs / s over the measured peak (0 without one); above ``MFU_BOUND`` it is shown
    as n/a (``mfu_text``)."""
    return flops_per_token * tokens_per_s / peak_flops if peak_flops > 0 else 0.0


def _metrics_file(path: str, start: int):
    """``--metrics-out`` of rank 0: a fresh run truncates it; a resumed run (start > 0) keeps
    the records of the steps before ``start`` (a run killed after its last save wrote some
    steps twice otherwise) and appends, so after any number of restarts it holds every step
    once."""
    from pathlib import Path

    if start > 0 and Path(path).is_file():
        kept = []
        with open(path) as f:
            for line in f:
                try:
                    if json.loads(line).get("step", -1) < start:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except ValueError:  # a line cut by a kill: dropped
                    pass
        with open(path, "w") as f:
            f.writelines(kept)
        return open(path, "a")
    return open(path, "w")


# ---------------------------------------------------------------------------- the run's metrics
# what rank 0 alone gathers each step (every rank's numbers; ``MetricsProcessor.share`` hands
# them to the other ranks' kept records at the end of a run)
WORLD_KEYS = ("memory", "memory_per_rank", "traffic", "traffic_per_rank", "rss_peak",
              "rss_per_rank", "memory_trace_per_rank", "ledger_peak_per_rank")


class MetricsProcessor:
    """Everything a run measures and shows, on top of ``Trainer.step``'s record: each rank's
    memory, traffic and peak RSS (one metrics all-gather), tokens/s and MFU (the peak measured
    by every rank at once), the cuda peak; and where it goes — the live line, ``--metrics-out``
    (rank 0; the first record names the run for ``fived ledger --check``), ``--tensorboard`` —
    at ``--log-every``'s cadence, and the closing table."""

    def __init__(self, trainer: Any, train: Any, show: bool, peak_flops: float, start: int):
        from ..ledger.compute import model_flops_per_token

        t, rank = trainer, trainer.rank
        self.trainer, self.train, self.start = t, train, start
        self.tb = self.display = self.out = None
        if rank == 0 and train.tensorboard:
            from .tb import TensorBoard

            self.tb = TensorBoard(train.tensorboard)
        if peak_flops == MEASURE_PEAK:  # the MFU denominator: every rank's threads, at once
            if rank == 0 and show:
                print("measuring the matmul peak (every rank at once, 0.25 s) ...", flush=True)
            peak_flops = measure_world_peak(t.world, t.device)
            if rank == 0 and show:
                print(f"matmul peak {peak_flops / 1e9:.1f} GFLOP/s ({t.world} rank(s) measured at "
                      "once, summed:\n  the MFU denominator); step 1 ...", flush=True)
        self.peak_flops = peak_flops
        self._ledger_peaks: list[float] | None = None  # --memory-trace: the ledger's, once
        if rank == 0 and show:
            self.display = LiveDisplay(t.cfg, t.par, train, t.world, peak_flops)
        self.flops_per_token = model_flops_per_token(t.cfg)
        if rank == 0 and train.metrics_out:
            self.out = _metrics_file(train.metrics_out, start)

    def measure(self, rec: dict[str, Any]) -> list[dict[str, int]]:
        """Add tokens/s and MFU to ``rec``, and on rank 0 every rank's memory, traffic and RSS
        (``WORLD_KEYS``; the other ranks keep their own memory and traffic until ``share``);
        the memory per rank (what a checkpoint's manifest records, written by rank 0)."""
        t = self.trainer
        mem = t.engine.memory()
        stats, mems = t.gather_stats(mem), [mem]
        if stats is None:  # not rank 0
            rec["memory"], rec["traffic"] = mem, t.traffic.bytes_by_dim()
        else:
            mems, traffic = stats
            rec["memory"], rec["memory_per_rank"] = mems[0], mems
            rec["traffic"], rec["traffic_per_rank"] = traffic[0]["bytes"], traffic
            rec["rss_peak"] = max(r["peak"] for r in t.rss)  # VmHWM, the largest rank
            rec["rss_per_rank"] = t.rss
            if t.trace is not None:  # --memory-trace: every rank's peak live tensor bytes
                rec["memory_trace_per_rank"] = t.traced
                rec["ledger_peak_per_rank"] = self.ledger_peaks()
        rec["tokens_per_s"] = rec["tokens"] / rec["seconds"]
        rec["mfu"] = mfu_of(self.flops_per_token, rec["tokens_per_s"], self.peak_flops)
        if t.device.type == "cuda":  # measured, next to the ledger's (gpu_check.sh)
            import torch

            rec["cuda_max_allocated"] = torch.cuda.max_memory_allocated(t.device)
            rec["cuda_build_allocated"] = t.build_cuda
        return mems

    def ledger_peaks(self) -> list[float]:
        """The ledger's step peak of every rank (the same for every step: worked out once)."""
        if self._ledger_peaks is None:
            from ..ledger.verify import predict_peak

            t = self.trainer
            self._ledger_peaks = [predict_peak(t.cfg, t.par, self.train.global_batch, r,
                                               self.train.optimizer) for r in range(t.world)]
        return self._ledger_peaks

    def share(self, records: Any) -> None:
        """The end of a run: rank 0's every-rank measurements (``WORLD_KEYS``) copied into the
        other ranks' kept records (one broadcast), so every rank returns the same summary."""
        t = self.trainer
        if t.world == 1:
            return
        import torch.distributed as dist

        recs = list(records)
        box = [[{k: r[k] for k in WORLD_KEYS if k in r} for r in recs] if t.rank == 0
               else None]
        dist.broadcast_object_list(box, src=0, group=t.world_metrics.pg)
        if t.rank != 0:
            for r, shared in zip(recs, box[0]):
                r.update(shared)

    def note(self, text: str) -> None:
        """A line above the live display (rank 0, when shown)."""
        if self.display:
            self.display.progress.console.print(text)

    def log(self, rec: dict[str, Any], step: int, end: int) -> None:
        """TensorBoard every step; the file and the live line at ``--log-every`` (always the
        first step, the last, an evaluation and a bad step)."""
        if self.tb:
            self.tb.log(rec)
        logged = (step == self.start or (step + 1) % self.train.log_every == 0 or step == end - 1
                  or "val_loss" in rec or rec["bad"])
        if self.out and logged:
            if step == self.start:  # what ran, so `fived ledger --check FILE` needs nothing else
                from dataclasses import asdict

                t = self.trainer
                rec = {**rec, "run": {"model": asdict(t.cfg), "parallel": asdict(t.par),
                                      "global_batch": self.train.global_batch,
                                      "optimizer": self.train.optimizer,
                                      "doc_mask": self.train.doc_mask}}
            self.out.write(json.dumps(rec) + "\n")
            self.out.flush()
        if self.display and logged:
            self.display.update(rec)

    def close(self) -> None:
        for x in (self.tb, self.display, self.out):
            if x is not None:
                x.close()

    def final(self, history: Any) -> None:
        """Every rank: rank 0's ``WORLD_KEYS`` into the kept records (``share``); then the
        closing table (rank 0, when shown) and the validation losses by step."""
        self.share(history.records)
        if not self.display:
            return
        self.display.final_table(list(history.records), history)
        if history.evals:
            self.display.console.print("validation loss by step: " + ", ".join(
                f"{s}: {v:.4f}" for s, v in history.evals))
