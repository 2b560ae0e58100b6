"""fived's pipeline schedules against ``torch.distributed.pipelining`` on the same stages.

``fived bench pp [--pp 4] [--micro-batches 8] [--reps 5]``: one spawn of pp gloo ranks; for
GPipe and 1F1B both implementations run forward+backward of the same stage modules on the same
micro-batches; the step time is the slowest rank's, the median over repetitions (after one
warm-up). Prints a header at once, one progress line per run, and a closing ratio table
(fived / torch; ≤ 1.0 is the target). Interleaved is not compared yet.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn

PAIRS = (("gpipe", "ScheduleGPipe"), ("1f1b", "Schedule1F1B"))


class _NoEngine:
    def set_last_micro(self, last: bool) -> None:
        pass


class _Wrap(nn.Module):
    def __init__(self, m: nn.Module, positions: torch.Tensor):
        super().__init__()
        self.m, self.positions = m, positions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(x, self.positions)


def _rank(rank: int, world: int, model_name: str, m: int, batch: int, reps: int) -> list:
    import torch.distributed as dist
    from torch.distributed import pipelining as tp

    from ..comm.ops import Traffic
    from ..config import ParallelConfig, preset
    from ..grid import Grid
    from ..model.layers import token_losses
    from ..parallel.pipeline.runtime import PipelineExecutor
    from ..parallel.plan import Plan

    cfg = preset(model_name)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen)
    y = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen)
    pos = torch.arange(cfg.seq_len)
    scale = 1.0 / (batch * cfg.seq_len)
    rows = []
    for ours, theirs in PAIRS:
        par = ParallelConfig(pp=world, micro_batches=m, schedule=ours)
        grid = Grid.from_config(par, rank).connect(Traffic())
        ex = PipelineExecutor(cfg, par, Plan(cfg, par, 7, grid), grid)
        ex.measure = False
        chunk = ex.stage.chunk_models[0]
        stage = tp.PipelineStage(_Wrap(chunk, pos), rank, world, torch.device("cpu"),
                                 group=grid["pp"].pg)
        sched = getattr(tp, theirs)(stage, m, loss_fn=lambda o, t: token_losses(o, t) * scale)

        def run_fived(ex=ex):
            ex.run(x, y, pos, scale, _NoEngine())

        def run_torch(sched=sched):
            if rank == 0:
                sched.step(x)
            elif rank == world - 1:
                sched.step(target=y, losses=[])
            else:
                sched.step()

        for label, fn in (("fived", run_fived), ("torch", run_torch)):
            times = []
            for k in range(reps + 1):
                ex.stage.zero_grad(set_to_none=True)
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if k:
                    times.append(float(t))
            med = statistics.median(times)
            rows.append((ours, label, theirs if label == "torch" else ours, med))
            if rank == 0:
                print(f"  {ours:6s} {label:5s} median {med * 1e3:8.1f} ms over {reps} reps",
                      flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fived bench pp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    from ..launch import run_local

    print(f"fived bench pp: {a.model}, pp={a.pp}, m={a.micro_batches}, batch {a.global_batch}; "
          f"fived vs torch.distributed.pipelining, median of {a.reps} reps", flush=True)
    rows: Any = run_local(_rank, a.pp, (a.model, a.micro_batches, a.global_batch, a.reps),
                          timeout=600, collective_timeout=120)[0]
    from rich.console import Console
    from rich.table import Table

    t = Table(title="pipeline step (forward+backward), slowest rank")
    for c in ("schedule", "fived ms", "torch ms", "torch schedule", "fived / torch"):
        t.add_column(c)
    by = {(s, lab): (name, ms) for s, lab, name, ms in rows}
    for ours, theirs in PAIRS:
        f, tt = by[(ours, "fived")][1], by[(ours, "torch")][1]
        t.add_row(ours, f"{f * 1e3:.1f}", f"{tt * 1e3:.1f}", theirs, f"{f / tt:.2f}×")
    Console().print(t)
    return 0
