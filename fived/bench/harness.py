"""What ``fived bench ddp`` and ``fived bench zero`` share: the bench model and arguments, a
``Runner`` per variant (fived's engine, torch DDP), the alternating timing loop, the table.

The variants alternate inside every repetition (the order flips each time) and each
repetition times ``--steps`` optimizer steps after a warm-up; the table shows medians over
``--reps`` and the ratio to the PyTorch peer as the median of the per-repetition ratios
(``schema.ratio``). Fair peers: every torch peer steps with torch's fastest AdamW for its
tensors (``fastest_adamw``: fused) and the same global-norm clipping (``clip_grads``); the
optimizer's seconds (clip + AdamW) are a column for both sides, and the first step's loss of
every implementation is asserted equal on every rank (``check_losses``). Columns: step time,
ratio, optimizer time, model-state bytes per rank (params + grads + master + optimizer, from
the tensors held), bytes sent, and for fived the fraction of communication hidden by overlap::

    hidden = 1 − (comm wait with overlap) / (comm wait with --no-overlap)

(the no-overlap run waits for every byte after backward, so its wait is the whole
communication time; with overlap only the part backward did not cover remains).
"""

from __future__ import annotations

import argparse
import statistics
import textwrap
import time
from collections.abc import Callable
from typing import Any

from ..ui import flags
from ..ui.args import Parser
from . import schema

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
    flags.add_flag(ap, "bucket_mb", default=25.0, help="gradient bucket size in MiB, fived and "
                   "torch alike")
    ap.add_argument("--json", action="store_true", help="print the fived.bench JSON document "
                    "(docs/benchmarks.md) as the last line")


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
    """One implementation on this rank: a step function (returns the step's loss), its memory
    and (fived) comm readings. ``opt`` accumulates the optimizer's seconds (clip + AdamW) of
    the steps since the last ``take_opt``."""

    def __init__(self, name: str, step: Callable[[int], float], memory: Callable[[], int],
                 wait: Callable[[], tuple[float, float]] | None = None, peer: bool = False):
        self.name, self.step, self.memory, self.wait, self.peer = name, step, memory, wait, peer
        self.times: list[float] = []
        self.waits: list[float] = []
        self.sent: list[float] = []
        self.opts: list[float] = []
        self.cpus: list[float] = []
        self.opt = 0.0
        self.first_loss: float | None = None

    def timed_opt(self, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        fn()
        self.opt += time.perf_counter() - t0

    def take_opt(self) -> float:
        s, self.opt = self.opt, 0.0
        return s


def fived_runner(name: str, cfg: Any, par: Any, train: Any, rank: int, world: int,
                 batch: Callable[[int], tuple]) -> Runner:
    from ..comm.ops import Traffic
    from ..model import build_model
    from ..parallel.parallelize import parallelize
    from ..ranks.grid import Grid

    traffic = Traffic()
    grid = Grid.from_config(par, rank).connect(traffic)
    laid = parallelize(build_model(cfg, train.seed), grid, par, train)
    model, engine = laid.model, laid.engine
    scale = 1.0 / (train.global_batch * cfg.seq_len)

    def step(i: int) -> float:
        x, y, pos = batch(i)
        engine.zero_grad()
        engine.set_last_micro(True)
        loss = model(x, pos, y)
        (loss * scale).backward()
        engine.finish()
        runner.timed_opt(lambda: (engine.clip(train.grad_clip), engine.step(1e-3)))
        return float(loss.detach())

    def memory() -> int:
        m = engine.memory()
        return m["params"] + m["grads"] + m["master"] + m["optimizer"]

    def wait() -> tuple[float, float]:
        secs = traffic.seconds_by_dim()  # hybrid: the shard and the replicate groups
        s = sum(secs.get(k, 0.0) for k in ("dense", "dense_shard", "dp_replicate"))
        b = sum(traffic.bytes_by_dim().values())
        traffic.reset()
        return s, b

    runner = Runner(name, step, memory, wait)
    return runner


def torch_ddp_runner(cfg: Any, train: Any, bucket_mb: float, world: int,
                     batch: Callable[[int], tuple], peer: bool = False) -> Runner:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ..model import build_model

    model = build_model(cfg, train.seed)
    ddp = DDP(model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
    return torch_runner("torch DDP", model, ddp, cfg, train, world, batch, set_to_none=False,
                        peer=peer)


def fastest_adamw(params: Any, train: Any, lr: float = 1e-3) -> Any:
    """torch's fastest AdamW for these tensors: ``fused=True`` (one kernel over all of them;
    on this CPU 0.5 ms vs 1.7 ms default / 2.5 ms foreach for plain parameters, 0.8 ms vs
    6.2 / 1.4 ms for FSDP2's DTensor shards, see docs/benchmarks.md), ``foreach=True`` where a
    torch build has no fused kernel for them."""
    import torch
    from torch.distributed.tensor import DTensor

    params = list(params)
    # one kernel cannot take DTensors and plain tensors together (a TP model's unsharded
    # norms): one parameter group each, stepped one after the other
    groups = [{"params": g} for g in ([p for p in params if isinstance(p, DTensor)],
                                      [p for p in params if not isinstance(p, DTensor)]) if g]
    kw = dict(lr=lr, betas=(train.beta1, train.beta2), eps=train.eps, weight_decay=0.0)
    try:
        return torch.optim.AdamW(groups, fused=True, **kw)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(groups, foreach=True, **kw)


def clip_grads(params: list[Any], max_norm: float) -> None:
    """torch's global-norm clipping (``get_total_norm`` + ``clip_grads_with_norm_``, foreach)
    over parameters that may mix DTensors (TP/FSDP2 shards) and plain tensors (a DTensor
    model's unsharded norms): each kind's norm is taken on its own (a DTensor's made whole with
    ``full_tensor``), then combined — fived's ``engine.clip`` computes the same norm."""
    import torch
    from torch.distributed.tensor import DTensor

    groups: dict[bool, list[Any]] = {True: [], False: []}
    for p in params:
        if p.grad is not None:
            groups[isinstance(p.grad, DTensor)].append(p)
    sq = torch.zeros((), dtype=torch.float32)
    for ps in groups.values():
        if ps:
            n = torch.nn.utils.get_total_norm([p.grad for p in ps], 2.0, foreach=True)
            n = n.full_tensor() if isinstance(n, DTensor) else n
            sq = sq + n.float() ** 2
    total = sq.sqrt()
    for ps in groups.values():
        if ps:
            torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total, foreach=True)


def torch_runner(name: str, model: Any, forward: Any, cfg: Any, train: Any, world: int,
                 batch: Callable[[int], tuple], set_to_none: bool, peer: bool = False,
                 clip: Callable[[float], Any] | None = None) -> Runner:
    """A torch peer's step: ``forward`` (the wrapped model) on the batch, the fastest AdamW
    (``fastest_adamw``) and the same global-norm clipping as fived (``clip_grads``).

    Torch's wrappers average gradients over the world and fived sums them, so the peer's loss is
    scaled by ``world`` to backpropagate the same gradient. ``clip(max_norm)`` replaces
    ``clip_grads`` where the wrapper has its own (FSDP1's ``clip_grad_norm_`` knows its flat
    shards)."""

    opt = fastest_adamw(model.parameters(), train)
    params = list(model.parameters())
    scale = world / (train.global_batch * cfg.seq_len)

    def optimizer() -> None:
        if clip is None:
            clip_grads(params, train.grad_clip)
        else:
            clip(train.grad_clip)
        opt.step()

    def step(i: int) -> float:
        x, y, pos = batch(i)
        opt.zero_grad(set_to_none=set_to_none)
        loss = forward(x, pos, y)
        (loss * scale).backward()
        runner.timed_opt(optimizer)
        return float(loss.detach())

    runner = Runner(name, step, lambda: state_bytes_torch(model, opt), peer=peer)
    return runner


def check_losses(runners: list[Runner], rank: int, rtol: float = 1e-4) -> None:
    """Every implementation computed the same first loss (same weights, same batch) on this
    rank; an ``AssertionError`` names the ones that did not."""
    ref = runners[0]
    for r in runners[1:]:
        a, b = ref.first_loss, r.first_loss
        assert a is not None and b is not None
        assert abs(a - b) <= rtol * max(abs(a), abs(b)), (
            f"rank {rank}: {ref.name} loss {a!r} != {r.name} loss {b!r}")


def run_rank(rank: int, world: int, build: Callable, args: argparse.Namespace) -> list[dict]:
    """``build(cfg, par, train, args, rank, world, batch)``: the variants (a module-level
    function, so that spawned ranks can import it)."""
    import torch
    import torch.distributed as dist

    from ..config import TrainConfig
    from ..train import data

    cfg = bench_model(args)
    train = TrainConfig(global_batch=args.global_batch, seed=1234, corpus_mb=1.0)
    positions = torch.arange(cfg.seq_len)

    def batch(i: int) -> tuple:
        x, y = data.local_batch(i, train.seed, train.global_batch, cfg.seq_len, rank, world,
                             train.corpus_mb)
        return x, y, positions

    from ..config import ParallelConfig

    par = ParallelConfig(dp=world, bucket_mb=args.bucket_mb)
    if getattr(args, "hsdp", 0):  # ``fived bench zero --hsdp N``: ZeRO over N, replicas across
        par = ParallelConfig(dp=world, dp_shard=args.hsdp, zero=3, bucket_mb=args.bucket_mb)
    runners = build(cfg, par, train, args, rank, world, batch)
    for r in runners:
        for i in range(max(1, args.warmup)):
            loss = r.step(i)
            if i == 0:
                r.first_loss = loss
        r.take_opt()
        if r.wait:
            r.wait()
    check_losses(runners, rank)
    dist.barrier()
    for rep in range(args.reps):
        order = runners if rep % 2 == 0 else list(reversed(runners))
        for r in order:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(args.steps):
                r.step(rep * args.steps + i)
            rt = torch.tensor([(time.perf_counter() - t0) / args.steps, r.take_opt() / args.steps],
                              dtype=torch.float64)
            cpu = torch.tensor([(time.process_time() - c0) / args.steps], dtype=torch.float64)
            dist.all_reduce(rt, op=dist.ReduceOp.MAX)  # a step ends on the slowest rank
            dist.all_reduce(cpu)  # the CPU work of a step: every rank's, all its threads
            r.times.append(float(rt[0]))
            r.opts.append(float(rt[1]))
            r.cpus.append(float(cpu[0]))
            if r.wait:
                w, b = r.wait()
                r.waits.append(w / args.steps)
                r.sent.append(b / args.steps)
        if rank == 0:
            line = "  ".join(f"{r.name} {r.times[-1] * 1e3:7.1f} ms" for r in runners)
            print(f"  rep {rep + 1}/{args.reps}: {line}", flush=True)
    return [{"name": r.name, "peer": r.peer, "step_s": statistics.median(r.times),
             "times": r.times, "optimizer_s": statistics.median(r.opts),
             "cpu_s": statistics.median(r.cpus),
             "state_bytes": r.memory(), "first_loss": r.first_loss,
             "bytes_sent": max(r.sent) if r.sent else None,
             "wait_s": statistics.median(r.waits) if r.waits else None} for r in runners]


def hidden_fraction(rows: list[dict], overlap: str, serial: str) -> float | None:
    by = {r["name"]: r for r in rows}
    if overlap not in by or serial not in by or not by[serial]["wait_s"]:
        return None
    return max(0.0, 1.0 - by[overlap]["wait_s"] / by[serial]["wait_s"])


def schema_rows(rows: list[dict], variant: str, hidden: dict[str, float | None]
                ) -> list[dict]:

    return [schema.row(variant, r["name"], r["step_s"], peer=r["peer"],
                       state_bytes=r["state_bytes"], bytes_sent=r["bytes_sent"],
                       optimizer_s=r["optimizer_s"], times_s=r["times"],
                       first_loss=r["first_loss"], comm_wait_s=r["wait_s"], cpu_s=r["cpu_s"],
                       comm_hidden=hidden.get(r["name"])) for r in rows]


def report(doc: dict) -> None:
    """The closing table (80 columns): one row per implementation."""
    from rich.console import Console
    from rich.table import Table

    peer = next((r["implementation"] for r in doc["rows"] if r["peer"]), "?")
    t = Table(title=f"medians over the repetitions; ratio = paired median vs {peer}")
    for c in ("implementation", "step ms", "ratio", "optim ms", "state MiB", "sent MiB",
              "hidden"):
        t.add_column(c, justify="right" if c != "implementation" else "left")
    for r in doc["rows"]:
        h = r["extra"].get("comm_hidden")
        t.add_row(r["implementation"], f"{r['step_s'] * 1e3:.1f}", f"{r['ratio']:.2f}×",
                  f"{r['optimizer_s'] * 1e3:.2f}", f"{r['state_bytes'] / 2**20:.2f}",
                  "-" if r["bytes_sent"] is None else f"{r['bytes_sent'] / 2**20:.2f}",
                  "-" if h is None else f"{h:.0%}")
    Console(width=80).print(t)
    print(textwrap.fill("state = params + grads + master + optimizer bytes per rank; sent = bytes one rank "
          "sent per step (fived.comm; torch's collectives are not counted); hidden = 1 − comm "
          "wait / no-overlap comm wait; optim = clip + AdamW. Every implementation computed "
          "the same first loss on every rank (checked).", 80))


@schema.json_stdout
def main(argv: list[str], kind: str, build: Callable, hidden: Callable[[list[dict]], dict],
         peer: str | Callable[[argparse.Namespace], str], what: str, description: str,
         variant: str | None = None,
         more_args: Callable[[argparse.ArgumentParser], None] | None = None,
         check: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None
         ) -> int:
    """Parse the common arguments (and ``more_args``'s; ``check`` refuses bad values with
    exit 2), run ``build``'s variants on ``--nprocs`` ranks, report against ``peer`` (or
    ``peer(args)``) with ``hidden(rows)`` as the comm-hidden column."""
    ap = Parser(prog=f"fived bench {kind}", description=description)
    common_args(ap)
    if more_args is not None:
        more_args(ap)
    args = flags.parse(ap, argv)
    if check is not None:
        check(ap, args)
    if callable(peer):
        peer = peer(args)
    from ..ui.report import fold

    print(fold(HEADER.format(name=kind, what=what, n=args.nprocs,
                             model=f"h{args.hidden}·l{args.layers}·s{args.seq_len}",
                             reps=args.reps, steps=args.steps), indent="  "), flush=True)
    from ..ranks.launch import run_local, threads_per_rank

    t0 = time.perf_counter()
    rows = run_local(run_rank, args.nprocs, (build, args), timeout=900)[0]
    for r in rows:
        r["peer"] = r["name"] == peer
    doc = schema.document(kind, argv, schema_rows(rows, variant or kind, hidden(rows)),
                          settings=vars(args), extra={"peer": peer},
                          mach=schema.machine(threads_per_rank=threads_per_rank(args.nprocs)))
    report(doc)
    print(f"done in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.json:
        schema.emit(doc)
    return 0
