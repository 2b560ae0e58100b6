"""CPU time per step of fived's pipeline schedules against torch's, robust to a loaded machine.

    python -m benchmarks.pp_cpu_profile zb-v ScheduleZBVZeroBubble --pp 2 --layers 4

Both implementations run the same stage modules (as ``fived bench pp`` builds them), first one
then the other, ``--reps`` times each after a warm-up; per rank it prints the CPU seconds the
process spent per step (``time.process_time``, every thread) and the wall seconds, the summed
loss of both (fived's Σ CE · scale against torch's scaled losses), and rank 0's cProfile top
functions for each side. Wall time on a shared machine is mostly waiting for a core; CPU time
is the work each side does.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from dataclasses import replace

import torch


def _rank(rank: int, world: int, ours: str, theirs: str, layers: int, m: int, reps: int):
    import torch.distributed as dist
    from torch.distributed import pipelining as tp

    from fived.bench.pp import _NoEngine, _wrap
    from fived.comm.ops import Traffic
    from fived.config import V_SCHEDULES, ParallelConfig, TrainConfig, preset
    from fived.model import build_model
    from fived.model.layers import token_losses
    from fived.parallel.parallelize import parallelize
    from fived.ranks.grid import Grid

    cfg = replace(preset("tiny"), layers=layers)
    gen = torch.Generator().manual_seed(0)
    batch = 16
    x = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen)
    y = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=gen)
    pos = torch.arange(cfg.seq_len)
    scale = 1.0 / (batch * cfg.seq_len)
    v = 2 if ours in ("interleaved",) + V_SCHEDULES else 1
    par = ParallelConfig(pp=world, micro_batches=m, schedule=ours, virtual_stages=v)
    grid = Grid.from_config(par, rank).connect(Traffic())
    ex = parallelize(build_model(cfg, 7), grid, par, TrainConfig()).executor
    ex.measure = False
    ids = ex.stage.stage_ids
    stages = [tp.PipelineStage(_wrap(c, pos), ids[k], world * v, torch.device("cpu"),
                               group=grid["pp"].pg) for k, c in enumerate(ex.stage.chunk_models)]
    loss_fn = lambda o, t: token_losses(o, t) * scale  # noqa: E731
    sched = getattr(tp, theirs)(stages if v > 1 else stages[0], m, loss_fn=loss_fn,
                                scale_grads=False)
    first, last = 0 in ids, world * v - 1 in ids

    def run_fived() -> float:
        return float(ex.run(x, y, pos, scale, _NoEngine())) * scale

    def run_torch() -> float:
        losses: list = []
        sched.step(*([x] if first else []), **({"target": y, "losses": losses} if last else {}))
        return sum(float(t.detach()) for t in losses)

    out = {"loss": (run_fived(), run_torch())}
    for label, fn in (("fived", run_fived), ("torch", run_torch)):
        prof = cProfile.Profile()
        cpu = wall = 0.0
        for _ in range(reps):
            ex.stage.zero_grad(set_to_none=True)
            dist.barrier()
            c0, w0 = time.process_time(), time.perf_counter()
            prof.enable()
            fn()
            prof.disable()
            cpu += time.process_time() - c0
            wall += time.perf_counter() - w0
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(10)
        out[label] = (cpu / reps, wall / reps, text.getvalue() if rank == 0 else "")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("schedule", help="fived's schedule (gpipe, 1f1b, interleaved, zb-v, ...)")
    ap.add_argument("torch_schedule", help="torch's class, e.g. ScheduleZBVZeroBubble")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    from fived.ranks.launch import run_local

    print(f"{a.schedule} vs {a.torch_schedule}: pp={a.pp}, m={a.micro_batches}, "
          f"{a.layers} layers, {a.reps} reps each", flush=True)
    out = run_local(_rank, a.pp, (a.schedule, a.torch_schedule, a.layers, a.micro_batches,
                                  a.reps), timeout=900, collective_timeout=300)
    for r, res in enumerate(out):
        lf, lt = res["loss"]
        print(f"rank {r}: cpu fived {res['fived'][0] * 1e3:.1f} ms, torch "
              f"{res['torch'][0] * 1e3:.1f} ms; wall fived {res['fived'][1] * 1e3:.1f} ms, "
              f"torch {res['torch'][1] * 1e3:.1f} ms; loss fived {lf:.6f} torch {lt:.6f}")
    for label in ("fived", "torch"):
        print(f"===== {label}, rank 0 (cProfile, by own time)")
        print(out[0][label][2])


if __name__ == "__main__":
    main()
