"""fived's pipeline schedules against ``torch.distributed.pipelining`` on the same stages.

``fived bench pp [--pp 4] [--micro-batches 8] [--layers 8] [--reps 5] [--schedules zb-v,...]``
(``--schedules``: only those pairs): one spawn of pp gloo ranks; for GPipe, 1F1B, interleaved
1F1B (v=2 virtual stages per rank), ZB-V and DualPipe-V (two stages per rank in a V; torch's
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``) both implementations run forward+backward
of the same stage modules on the same micro-batches, alternating fived and torch repetition by
repetition so that machine noise hits both alike; the step time is the
slowest rank's, the median over repetitions (after one warm-up each). Prints a header at once,
one progress line per schedule, and a closing ratio table (fived / torch; ≤ 1.0 is the target)
with the relative gap between the two implementations' gradients (the same work, checked) and
the losses asserted equal on the last stage.
ZB-H1 has no same-shape torch peer (torch's zero-bubble schedules are interleaved/V-shaped) and
is not compared; DualPipe-V runs when m ≥ 2·pp.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

from ..ui import flags
from ..ui.args import Parser
from . import schema

PAIRS = (("gpipe", "ScheduleGPipe", 1), ("1f1b", "Schedule1F1B", 1),
         ("interleaved", "ScheduleInterleaved1F1B", 2), ("zb-v", "ScheduleZBVZeroBubble", 2),
         ("dualpipe-v", "ScheduleDualPipeV", 2))


class _NoEngine:
    def set_last_micro(self, last: bool) -> None:
        pass


def _wrap(m: Any, positions: Any) -> Any:
    """A chunk with its positions bound: the module torch's ``PipelineStage`` calls as m(x)."""
    from torch import nn

    class Wrap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m, self.positions = m, positions

        def forward(self, x: Any) -> Any:
            return self.m(x, self.positions)

    return Wrap()


def _rank(rank: int, world: int, model_name: str, layers: int, m: int, batch: int,
          reps: int, only: tuple[str, ...] = ()) -> list:
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining as tp

    from ..comm.ops import Traffic
    from ..config import ParallelConfig, TrainConfig, preset
    from ..model import build_model
    from ..model.layers import token_losses
    from ..parallel.parallelize import parallelize
    from ..ranks.grid import Grid

    cfg = replace(preset(model_name), layers=layers)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen)
    y = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen)
    pos = torch.arange(cfg.seq_len)
    scale = 1.0 / (batch * cfg.seq_len)
    rows = []
    for ours, theirs, v in PAIRS:
        if (cfg.layers % (world * v) or (ours == "dualpipe-v" and m < 2 * world)
                or (only and ours not in only)):
            continue
        par = ParallelConfig(pp=world, micro_batches=m, schedule=ours, virtual_stages=v)
        grid = Grid.from_config(par, rank).connect(Traffic())
        ex = parallelize(build_model(cfg, 7), grid, par, TrainConfig()).executor
        ex.measure = False
        ids = ex.stage.stage_ids  # r, r + pp (loop) or r, 2pp − 1 − r (V)
        stages = [tp.PipelineStage(_wrap(chunk, pos), ids[k], world * v,
                                   torch.device("cpu"), group=grid["pp"].pg)
                  for k, chunk in enumerate(ex.stage.chunk_models)]
        loss_fn = lambda o, t: token_losses(o, t) * scale  # noqa: E731
        cls = getattr(tp, theirs)
        sched = (cls(stages, m, loss_fn=loss_fn, scale_grads=False) if v > 1
                 else cls(stages[0], m, loss_fn=loss_fn, scale_grads=False))

        losses: dict[str, float] = {}

        first, last = 0 in ids, world * v - 1 in ids  # V: rank 0 holds both ends

        def run_fived(ex=ex, losses=losses):
            losses["fived"] = float(ex.run(x, y, pos, scale, _NoEngine()))

        def run_torch(sched=sched, losses=losses, first=first, last=last):
            out: list = []
            sched.step(*([x] if first else []), **({"target": y, "losses": out} if last else {}))
            if last:
                losses["torch"] = float(sum(out).detach()) / scale  # the summed token loss, as fived's

        times: dict[str, list[float]] = {"fived": [], "torch": []}
        for k in range(reps + 1):
            for label, fn in (("fived", run_fived), ("torch", run_torch)):
                ex.stage.zero_grad(set_to_none=True)
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if k:
                    times[label].append(float(t))
        med = {label: statistics.median(ts) for label, ts in times.items()}
        grads = []
        for fn in (run_fived, run_torch):  # the same work: both give the same gradients
            ex.stage.zero_grad(set_to_none=True)
            fn()
            grads.append([p.grad.clone() for p in ex.stage.parameters()])
        gap = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                  for a, b in zip(*grads))
        if last:  # the last stage computed the loss: fived's = torch's
            lf, lt = losses["fived"], losses["torch"]
            assert abs(lf - lt) <= 1e-4 * abs(lt), f"{ours}: loss fived {lf} != torch {lt}"
        gap_t = torch.tensor([gap], dtype=torch.float64)
        dist.all_reduce(gap_t, op=dist.ReduceOp.MAX)
        rows.append((ours, theirs, med["fived"], med["torch"], float(gap_t)))
        if rank == 0:
            print(f"  {ours:11s} fived {med['fived'] * 1e3:8.1f} ms   torch {med['torch'] * 1e3:8.1f} ms"
                  f"   (median of {reps})", flush=True)
    return rows


@schema.json_stdout
def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="fived bench pp", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_flag(ap, "pp", default=4, help="pipeline ranks (local gloo processes)")
    flags.add_flag(ap, "micro_batches", default=8,
                   help="micro-batches per step (interleaved needs a multiple of pp)")
    flags.add_flag(ap, "global_batch", default=16,
                   help="sequences per step, split into the micro-batches")
    flags.add_flag(ap, "model", default="tiny")
    ap.add_argument("--layers", type=int, default=8,
                    help="layers of the model (default 8: pp=4 × v=2 interleaved has one per stage)")
    ap.add_argument("--reps", type=int, default=5,
                    help="timed repetitions per implementation and schedule, after one warm-up; "
                    "the median is reported (default 5)")
    ap.add_argument("--schedules", default="", help="comma-separated subset of "
                    f"{', '.join(p[0] for p in PAIRS)} (default: all)")
    ap.add_argument("--json", action="store_true", help="also print the fived.bench JSON "
                    "document (docs/benchmarks.md) as the last line")
    argv = sys.argv[1:] if argv is None else argv
    a = flags.parse(ap, argv)
    only = tuple(x for x in a.schedules.split(",") if x)
    unknown = set(only) - {p[0] for p in PAIRS}
    if unknown:
        ap.error(f"--schedules: no torch peer for {', '.join(sorted(unknown))}")
    from ..ranks.launch import run_local
    from ..ui.report import fold

    print(fold(f"fived bench pp: {a.model} with {a.layers} layers, pp={a.pp}, "
               f"m={a.micro_batches}, batch {a.global_batch}; fived vs "
               f"torch.distributed.pipelining, median of {a.reps} reps", indent="  "), flush=True)
    args = (a.model, a.layers, a.micro_batches, a.global_batch, a.reps, only)
    rows: Any = run_local(_rank, a.pp, args, timeout=600, collective_timeout=120)[0]
    from rich.console import Console
    from rich.table import Table

    t = Table(title="pipeline step (forward+backward), slowest rank")
    for c in ("schedule", "fived ms", "torch ms", "torch schedule", "fived / torch", "grad gap"):
        t.add_column(c)
    for ours, theirs, f, tt, gap in rows:
        t.add_row(ours, f"{f * 1e3:.1f}", f"{tt * 1e3:.1f}", theirs, f"{f / tt:.2f}×", f"{gap:.1e}")
    Console().print(t)
    if a.json:
        schema.emit(_document(argv, a, rows))
    return 0


def _document(argv: list[str], a: argparse.Namespace, rows: Any) -> dict:
    """The ``fived.bench`` document: per schedule a fived row and its torch peer row (no
    optimizer, no model-state comparison: both run the same stage modules)."""
    from ..ranks.launch import threads_per_rank

    out = []
    for ours, theirs, f, tt, gap in rows:
        out.append(schema.row(ours, "fived", f, grad_rel_gap=gap))
        out.append(schema.row(ours, "torch", tt, peer=True, torch_schedule=theirs))
    return schema.document("pp", argv, out, settings=vars(a),
                           extra={"note": "forward+backward of one step, slowest rank"},
                           mach=schema.machine(threads_per_rank=threads_per_rank(a.pp)))
