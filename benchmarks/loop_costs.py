"""The training loop's fixed costs, and the loop against a PyTorch peer (docs/benchmarks.md,
"The loop's fixed costs").

``python benchmarks/loop_costs.py [--nprocs 4 --zero 3] [--model small] [--global-batch 8]``
``python benchmarks/loop_costs.py --fold [--nprocs 4]``

Every rank runs ``train_rank`` itself — the loop ``fived train`` runs, rank 0's live line on
(written to /dev/null), the default ``--preempt-signals`` and ``--log-every 1`` — with a run hook
whose ``on_step_start`` does two things, alternating with the loop step by step:

1. the peer's step on the same ranks, shape and data: ``fully_shard`` per block and on the root
   (FSDP2) with AdamW (``--peer-adamw foreach|fused``) and the same global-norm clipping on
   several ranks; on one rank the plain loop (``loss.backward()``, AdamW, clipping);
2. each fixed piece of the loop ``--calls`` times in a row (after a barrier), on this rank's
   trainer: the preemption agreement, the loss all-reduce, the bad-step check, the RSS sample,
   the metrics gather and the live line + metrics record.

A loop step's time is the time between two ``on_step_start`` calls less the hook's own time; a
piece's cost is its median per call over the steps, the largest over the ranks (a collective
ends with its slowest rank). The table gives each piece in µs per step and as a share of the
loop's median step; the last line is the loop's median step over the peer's (ratio of medians,
the two alternating in one run). ``--json`` prints the numbers as one JSON line.

``--fold``: what carrying the preemption vote in the loss all-reduce costs — a 1-element
all-reduce (the loss alone), a 2-element one (loss and vote) and two 1-element ones (the loss,
then an agreement of its own) over the world, alternated, 10 calls per repetition, medians.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import statistics
import time
from typing import Any

PIECES = ("preemption agreement", "loss all-reduce", "bad-step check", "RSS sample",
          "metrics gather", "live line + metrics record")


def _timed(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


class Probe:
    """The run hook: the peer's step and the pieces, timed, at every step start."""

    def __init__(self, opts: argparse.Namespace, train: Any):
        self.opts, self.train = opts, train
        self.marks: list[tuple[float, float]] = []  # (hook entered, hook left)
        self.peer: list[float] = []
        self.pieces: dict[str, list[float]] = {p: [] for p in PIECES}
        self.peer_step = None

    def _setup(self, trainer: Any) -> None:
        import torch

        from fived.bench.harness import clip_grads
        from fived.model import build_model
        from fived.train import data as builtin_data

        cfg, world, rank, t = trainer.cfg, trainer.world, trainer.rank, self.train
        model = build_model(cfg, t.seed)
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for block in model.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        kind = {"fused": True} if self.opts.peer_adamw == "fused" else {"foreach": True}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(t.beta1, t.beta2), eps=t.eps,
                                weight_decay=0.0, **kind)
        params = list(model.parameters())
        scale = world / (t.global_batch * cfg.seq_len)  # FSDP2 averages: the same gradient
        pos = torch.arange(cfg.seq_len)

        def step(i: int) -> None:
            x, y = builtin_data.local_batch(i, t.seed, t.global_batch, cfg.seq_len, rank, world,
                                            t.corpus_mb)
            opt.zero_grad(set_to_none=True)
            (model(x, pos, y) * scale).backward()
            clip_grads(params, t.grad_clip)
            opt.step()

        self.peer_step = step

    def _pieces(self, trainer: Any, step: int) -> None:
        import torch
        import torch.distributed as dist

        from fived.train import resilience
        from fived.train.metrics import MetricsProcessor, rss_peak

        n, world = self.opts.calls, trainer.world
        local = torch.tensor(123.0)
        rec = {"step": step, "loss": 5.0, "tokens": self.train.global_batch * trainer.cfg.seq_len,
               "seconds": 0.1, "lr": 1e-3, "grad_norm": 1.0, "skipped": False, "bad": False}
        fp16 = trainer.par.precision == "fp16"
        bad = resilience.BadSteps(3)
        spec = self.train.preempt_signals
        if "device" in inspect.signature(resilience.Preemption).parameters:
            preempt = resilience.Preemption(spec, trainer.device, world)  # a collective per step
            agree, with_vote = preempt.agreed, ()
        else:  # the vote rides on the loss all-reduce: no collective of its own
            preempt = resilience.Preemption(spec)
            agree, with_vote = None, (preempt,)

        def barrier():
            if world > 1:
                dist.barrier()

        barrier()
        self.pieces["preemption agreement"].append(_timed(agree, n) if agree else 0.0)
        preempt.close()
        barrier()
        self.pieces["loss all-reduce"].append(_timed(lambda: trainer.global_loss(local, *with_vote), n))
        self.pieces["bad-step check"].append(_timed(
            lambda: bad.update({**rec, "bad": resilience.non_finite(5.0, 1.0, fp16)}), n))
        self.pieces["RSS sample"].append(_timed(rss_peak, n))
        if not hasattr(self, "metrics"):
            with contextlib.redirect_stdout(open(os.devnull, "w")):
                self.metrics = MetricsProcessor(trainer, self.train, trainer.rank == 0, 0.0, 0)
            self.metrics.out = open(os.devnull, "w") if trainer.rank == 0 else None
        barrier()
        self.pieces["metrics gather"].append(_timed(lambda: self.metrics.measure(rec), n))
        self.metrics.measure(rec)
        with contextlib.redirect_stdout(open(os.devnull, "w")):
            self.pieces["live line + metrics record"].append(
                _timed(lambda: self.metrics.log(dict(rec), step + 1, 10**9), n))

    def on_step_start(self, trainer: Any, step: int) -> None:
        t0 = time.perf_counter()
        if self.peer_step is None:
            self._setup(trainer)
        if trainer.world > 1:
            import torch.distributed as dist

            dist.barrier()
        p0 = time.perf_counter()
        self.peer_step(step)
        if trainer.world > 1:
            dist.barrier()  # the peer's step ends on its slowest rank, as the loop's does
        self.peer.append(time.perf_counter() - p0)
        if step >= self.opts.warmup:
            self._pieces(trainer, step)
        self.marks.append((t0, time.perf_counter()))

    def loop_steps(self) -> list[float]:
        """Each loop step: from leaving the hook to entering it at the next step."""
        return [b[0] - a[1] for a, b in zip(self.marks, self.marks[1:])]


def _rank(rank: int, world: int, opts: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from fived.config import ParallelConfig, TrainConfig, preset
    from fived.train.trainer import train_rank

    cfg = preset(opts.model)
    par = ParallelConfig(dp=world, zero=opts.zero)
    train = TrainConfig(model=opts.model, steps=opts.warmup + opts.steps,
                        global_batch=opts.global_batch, seed=1234, corpus_mb=1.0)
    probe = Probe(opts, train)
    with contextlib.redirect_stdout(open(os.devnull, "w")):
        train_rank(rank, world, cfg, par, train, show=rank == 0, hooks=[probe])
    w = opts.warmup
    loop, peer = probe.loop_steps()[w:], probe.peer[w:-1]
    mine = [statistics.median(loop), statistics.median(peer)]
    mine += [statistics.median(probe.pieces[p]) for p in PIECES]
    t = torch.tensor(mine, dtype=torch.float64)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    ratios = [a / b for a, b in zip(loop, peer)]
    return {"loop_s": float(t[0]), "peer_s": float(t[1]),
            "pieces_s": dict(zip(PIECES, t[2:].tolist())),
            "paired_ratio": statistics.median(ratios)}


def _fold_rank(rank: int, world: int, reps: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    one, two = torch.zeros(1, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    runs = {"loss alone (1 element)": lambda: dist.all_reduce(one),
            "loss + vote (2 elements)": lambda: dist.all_reduce(two),
            "loss, then the agreement (2 x 1 element)": lambda: (dist.all_reduce(one),
                                                                 dist.all_reduce(one))}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for rep in range(reps):
        for name in (list(runs) if rep % 2 == 0 else list(reversed(runs))):
            dist.barrier()
            times[name].append(_timed(runs[name], 10))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--zero", type=int, default=3)
    ap.add_argument("--model", default="small")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=15, help="timed loop steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20, help="calls of each piece per step")
    ap.add_argument("--peer-adamw", choices=("foreach", "fused"), default="foreach")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--fold", action="store_true", help="time the loss all-reduce with and "
                    "without the preemption vote (below)")
    opts = ap.parse_args()
    from fived.ranks.launch import run_local

    if opts.fold:
        res = run_local(_fold_rank, opts.nprocs, (40,), timeout=600)
        print(f"{opts.nprocs} ranks, 40 alternated repetitions of 10 calls: µs per call, median "
              "(ranks 0..n-1)")
        for name in res[0]:
            print(f"| {name} | " + " | ".join(f"{r[name] * 1e6:.0f}" for r in res) + " |")
        return

    res = run_local(_rank, opts.nprocs, (opts,), timeout=1800)[0]
    loop = res["loop_s"]
    peer = "FSDP2 fully_shard" if opts.nprocs > 1 else "plain PyTorch loop"
    print(f"{opts.model}, {opts.nprocs} rank(s), ZeRO-{opts.zero}, global batch "
          f"{opts.global_batch}; {opts.steps} steps, {opts.calls} calls of each piece per step")
    print("| piece | µs/step | % of step |\n|---|---:|---:|")
    for p, s in res["pieces_s"].items():
        print(f"| {p} | {s * 1e6:.0f} | {100 * s / loop:.2f} |")
    print(f"loop step {loop * 1e3:.1f} ms, {peer} ({opts.peer_adamw} AdamW) step "
          f"{res['peer_s'] * 1e3:.1f} ms: ratio of medians {loop / res['peer_s']:.3f} "
          f"(median of paired ratios {res['paired_ratio']:.3f})")
    if opts.json:
        print(json.dumps({"settings": vars(opts), **res}))


if __name__ == "__main__":
    main()
