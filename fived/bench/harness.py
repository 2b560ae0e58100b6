"""What ``fived bench ddp`` and ``fived bench zero`` share: the bench model and arguments, a
``Runner`` per variant (fived's engine, torch DDP), the alternating timing loop, the table.

The variants alternate inside every repetition (the order flips each time) and each
repetition times ``--steps`` optimizer steps after a warm-up; the table shows medians over
``--reps``. Columns: step time and its ratio to the PyTorch peer, model-state bytes per rank
(params + grads + master + optimizer, from the tensors held), and for fived the fraction of
communication hidden by overlap::

    hidden = 1 − (comm wait with overlap) / (comm wait with --no-overlap)

(the no-overlap run waits for every byte after backward, so its wait is the whole
communication time; with overlap only the part backward did not cover remains).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from ..cli import flags

HEADER = "fived bench {name}: {what} — {n} ranks, model {model}, {reps} reps × {steps} steps"


def bench_model(args: argparse.Namespace):
    from ..config import ModelConfig

    return ModelConfig(name=f"h{args.hidden}-l{args.layers}", vocab=256, hidden=args.hidden,
                       layers=args.layers, heads=max(1, args.hidden // 32),
                       kv_heads=max(1, args.hidden // 64), ffn=args.hidden * 11 // 4,
                       seq_len=args.seq_len)


def common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--nprocs", type=int, default=2, help="ranks (all data-parallel)")
    ap.add_argument("--hidden", type=int, default=128, help="model width (default 128)")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    flags.add_flag(ap, "seq_len", default=64)
    flags.add_flag(ap, "global_batch", default=8, help="sequences per step over all ranks")
    ap.add_argument("--reps", type=int, default=5, help="alternating repetitions (median)")
    flags.add_flag(ap, "steps", default=3, help="timed optimizer steps per repetition")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    flags.add_flag(ap, "bucket_mb", default=25.0, help="gradient bucket size in MB, fived and "
                   "torch alike")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON too")


def state_bytes_torch(model: Any, opt: Any) -> int:
    """params + grads + optimizer state this rank holds (DTensor: the local shard)."""
    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    def nb(t: Any) -> int:
        t = local(t)
        return t.numel() * t.element_size()

    total = 0
    for p in model.parameters():
        total += nb(p)
        if p.grad is not None:
            total += nb(p.grad)
    for st in opt.state.values():
        for v in st.values():
            if hasattr(v, "numel") and v.numel() > 1:
                total += nb(v)
    return total


class Runner:
    """One variant on this rank: a step function plus its memory and comm-wait readings."""

    def __init__(self, name: str, step: Callable[[int], None], memory: Callable[[], int],
                 wait: Callable[[], float] | None = None):
        self.name, self.step, self.memory, self.wait = name, step, memory, wait
        self.times: list[float] = []
        self.waits: list[float] = []


def fived_runner(name: str, cfg: Any, par: Any, train: Any, rank: int, world: int,
                 batch: Callable[[int], tuple]) -> Runner:
    from ..comm.ops import Traffic
    from ..dist.grid import Grid
    from ..model import build_model
    from ..parallel.parallelize import parallelize

    traffic = Traffic()
    grid = Grid.from_config(par, rank).connect(traffic)
    laid = parallelize(build_model(cfg, train.seed), grid, par, train)
    model, engine = laid.model, laid.engine
    scale = 1.0 / (train.global_batch * cfg.seq_len)

    def step(i: int) -> None:
        x, y, pos = batch(i)
        engine.zero_grad()
        engine.set_last_micro(True)
        (model(x, pos, y) * scale).backward()
        engine.finish()
        engine.clip(train.grad_clip)
        engine.step(1e-3)

    def memory() -> int:
        m = engine.memory()
        return m["params"] + m["grads"] + m["master"] + m["optimizer"]

    def wait() -> float:
        s = traffic.seconds_by_dim().get("dense", 0.0)
        traffic.reset()
        return s

    return Runner(name, step, memory, wait)


def torch_ddp_runner(cfg: Any, train: Any, bucket_mb: float, world: int,
                     batch: Callable[[int], tuple]) -> Runner:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..model import build_model

    model = build_model(cfg, train.seed)
    ddp = DDP(model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
    return torch_runner("torch DDP", model, ddp, cfg, train, world, batch, set_to_none=False)


def torch_runner(name: str, model: Any, forward: Any, cfg: Any, train: Any, world: int,
                 batch: Callable[[int], tuple], set_to_none: bool) -> Runner:
    """A torch peer's step: ``forward`` (the wrapped model) on the batch, AdamW, clipping.

    Torch's wrappers average gradients over the world and fived sums them, so the peer's loss is
    scaled by ``world`` to backpropagate the same gradient."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(train.beta1, train.beta2),
                            eps=train.eps, weight_decay=0.0)
    scale = world / (train.global_batch * cfg.seq_len)

    def step(i: int) -> None:
        x, y, pos = batch(i)
        opt.zero_grad(set_to_none=set_to_none)
        (forward(x, pos, y) * scale).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        opt.step()

    return Runner(name, step, lambda: state_bytes_torch(model, opt))


def run_rank(rank: int, world: int, build: Callable, args: argparse.Namespace) -> list[dict]:
    """``build(cfg, par, train, args, rank, world, batch)``: the variants (a module-level
    function, so that spawned ranks can import it)."""
    import torch
    import torch.distributed as dist

    from ..config import TrainConfig
    from ..train import data as D

    cfg = bench_model(args)
    train = TrainConfig(global_batch=args.global_batch, seed=1234, corpus_mb=1.0)
    positions = torch.arange(cfg.seq_len)

    def batch(i: int) -> tuple:
        x, y = D.local_batch(i, train.seed, train.global_batch, cfg.seq_len, rank, world,
                             train.corpus_mb)
        return x, y, positions

    from ..config import ParallelConfig

    par = ParallelConfig(dp=world, bucket_mb=args.bucket_mb)
    runners = build(cfg, par, train, args, rank, world, batch)
    for r in runners:
        for i in range(args.warmup):
            r.step(i)
        if r.wait:
            r.wait()
    dist.barrier()
    for rep in range(args.reps):
        order = runners if rep % 2 == 0 else list(reversed(runners))
        for r in order:
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(args.steps):
                r.step(rep * args.steps + i)
            elapsed = torch.tensor([(time.perf_counter() - t0) / args.steps])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends on the slowest rank
            r.times.append(float(elapsed))
            if r.wait:
                r.waits.append(r.wait() / args.steps)
        if rank == 0:
            line = "  ".join(f"{r.name} {r.times[-1] * 1e3:7.1f} ms" for r in runners)
            print(f"  rep {rep + 1}/{args.reps}: {line}", flush=True)
    return [{"name": r.name, "step_s": statistics.median(r.times), "times": r.times,
             "state_bytes": r.memory(),
             "wait_s": statistics.median(r.waits) if r.waits else None} for r in runners]


def hidden_fraction(rows: list[dict], overlap: str, serial: str) -> float | None:
    by = {r["name"]: r for r in rows}
    if overlap not in by or serial not in by or not by[serial]["wait_s"]:
        return None
    return max(0.0, 1.0 - by[overlap]["wait_s"] / by[serial]["wait_s"])


def report(rows: list[dict], peer: str, hidden: dict[str, float | None], as_json: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    base = next(r for r in rows if r["name"] == peer)
    t = Table(title=f"median step time over the repetitions; ratio = / {peer}")
    for c in ("variant", "step ms", "ratio", "model-state bytes/rank", "bytes ratio",
              "comm wait ms", "comm hidden"):
        t.add_column(c, justify="right" if c != "variant" else "left")
    for r in rows:
        h = hidden.get(r["name"])
        t.add_row(r["name"], f"{r['step_s'] * 1e3:.1f}", f"{r['step_s'] / base['step_s']:.2f}×",
                  f"{r['state_bytes']:,}", f"{r['state_bytes'] / base['state_bytes']:.3f}",
                  "-" if r["wait_s"] is None else f"{r['wait_s'] * 1e3:.1f}",
                  "-" if h is None else f"{h:.0%}")
    Console(width=140).print(t)
    if as_json:
        import json

        print(json.dumps({"rows": rows, "hidden": hidden}))


def main(argv: list[str], kind: str, build: Callable, hidden: Callable[[list[dict]], dict],
         peer: str, what: str, description: str) -> int:
    """Parse the common arguments, run ``build``'s variants on ``--nprocs`` ranks, report
    against ``peer`` with ``hidden(rows)`` as the comm-hidden column."""
    ap = argparse.ArgumentParser(prog=f"fived bench {kind}", description=description)
    common_args(ap)
    args = flags.parse(ap, argv)
    print(HEADER.format(name=kind, what=what, n=args.nprocs,
                        model=f"h{args.hidden}·l{args.layers}·s{args.seq_len}", reps=args.reps,
                        steps=args.steps), flush=True)
    from ..dist.launch import run_local

    t0 = time.perf_counter()
    rows = run_local(run_rank, args.nprocs, (build, args), timeout=900)[0]
    report(rows, peer, hidden(rows), args.json)
    print(f"done in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0
