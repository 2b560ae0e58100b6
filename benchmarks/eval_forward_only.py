"""Evaluation time: forward only under no_grad (``Trainer.evaluate``) vs the old path (each
validation batch a training micro-step with a zero loss scale: ``fived.testing.
micro_step_evaluate``), alternated in the same processes, ROUNDS rounds per layout; the ratio
of the medians (new / old) and the two losses' largest relative difference.

    PYTHONPATH=. python benchmarks/eval_forward_only.py [--model small] [--rounds 7]

The data: this repository's own Python files, prepared byte-level into a temporary directory.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from fived.config import ParallelConfig, preset, validate
from fived.data.meta import model_for_data
from fived.data.prepare import Options, prepare
from fived.testing import run_ranks, small_train

LAYOUTS = [
    ("1 rank", 1, {}),
    ("dp2", 2, dict(dp=2)),
    ("tp2", 2, dict(tp=2)),
    ("pp2 1f1b m2", 2, dict(pp=2, micro_batches=2, schedule="1f1b")),
    ("dp2 zero3", 2, dict(dp=2, zero=3)),
    ("ep2 (moe)", 2, dict(ep=2)),
]


def _rank(rank: int, world: int, model, par, train, rounds: int) -> dict:
    import torch
    import torch.distributed as dist

    from fived.testing import micro_step_evaluate
    from fived.train.trainer import Trainer

    torch.manual_seed(train.seed)
    t = Trainer(model, par, train, rank, world)
    t.step(0)

    def timed(fn):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        v = fn()
        if world > 1:
            dist.barrier()
        return time.perf_counter() - t0, v

    new, old, diff = [], [], 0.0
    timed(lambda: t.evaluate()), timed(lambda: micro_step_evaluate(t))  # warm-up
    for r in range(rounds):
        order = ((new, lambda: t.evaluate()["val_loss"]), (old, lambda: micro_step_evaluate(t)))
        vals = []
        for out, fn in (order if r % 2 == 0 else order[::-1]):
            s, v = timed(fn)
            out.append(s)
            vals.append(v)
        diff = max(diff, abs(vals[0] - vals[1]) / abs(vals[1]))
    t.close()
    return {"new": statistics.median(new), "old": statistics.median(old), "diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", type=int, default=4)
    args = ap.parse_args()
    root = Path(__file__).resolve().parents[1] / "fived"
    with tempfile.TemporaryDirectory() as tmp:
        prepare(Options((str(root),), str(Path(tmp) / "d"), glob="*.py", val_fraction=0.2,
                        workers=1), lambda s: None)
        data = str(Path(tmp) / "d")
        print(f"model {args.model}(-moe for ep), global batch 8, {args.batches} val batches, "
              f"{args.rounds} rounds alternated; medians in seconds")
        print(f"{'layout':<14} {'old (fwd+bwd)':>14} {'new (no_grad)':>14} {'new/old':>8} "
              f"{'|Δloss|/loss':>13}")
        for name, world, kw in LAYOUTS:
            mname = "tiny-moe" if "ep" in kw else args.model
            model = model_for_data(preset(mname), data)
            par = ParallelConfig(**kw)
            train = small_train(steps=1, data=data, eval_every=1, eval_batches=args.batches)
            validate(model, par, train, world)
            if world == 1:
                r = _rank(0, 1, model, par, train, args.rounds)
            else:
                r = run_ranks(_rank, world, model, par, train, args.rounds, timeout=900)[0]
            print(f"{name:<14} {r['old']:>14.4f} {r['new']:>14.4f} "
                  f"{r['new'] / r['old']:>8.3f} {r['diff']:>13.1e}", flush=True)


if __name__ == "__main__":
    main()
