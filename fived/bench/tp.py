"""``fived bench tp``: fived's tensor (+ sequence) parallelism against PyTorch's DTensor.

The same Llama-style model (the one-rank build of ``fived.model``) is parallelized two ways on
the same ranks in one run:

* fived: ``apply_tp`` (+ ``sequence_parallel``) — column/row linears on ``fived.comm``,
  vocab-parallel embedding and cross-entropy;
* DTensor: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` (+
  ``SequenceParallel`` and ``PrepareModuleInput`` for SP), a ``RowwiseParallel`` embedding and a
  ``ColwiseParallel`` head whose vocab-sharded logits go to ``loss_parallel`` cross-entropy —
  the torchtitan recipe.

One timed step = forward + backward of the summed token loss (no optimizer: both sides would run
the same AdamW). Repetitions interleave the variants so load drifts hit all of them alike; the
table reports medians and fived / DTensor. Both sides' first losses are printed: they must agree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from ..cli import flags

VARIANTS = ("fived", "dtensor")


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="fived bench tp", description=__doc__.split("\n")[0])
    flags.add_flag(ap, "tp", default=2, help="tensor-parallel ranks (local processes)")
    flags.add_flag(ap, "model", default="small")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per variant")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repetitions per variant")
    ap.add_argument("--sp", choices=("both", "on", "off"), default="both",
                    help="sequence parallelism: off, on, or both (default)")
    flags.add_flag(ap, "overlap", default=True, help="fived with the dX-collective / "
                   "weight-gradient overlap (--no-overlap: without)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON at the end")
    args = flags.parse(ap, argv)
    args.no_overlap = not args.overlap
    return args


def dtensor_model(cfg: Any, seed: int, tp: int, sp: bool) -> torch.nn.Module:
    """The one-rank fived model parallelized by ``torch.distributed.tensor.parallel``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from ..model import build_model

    model = build_model(cfg, seed)  # plain nn.Linear / nn.Embedding: DTensor takes it as it is
    mesh = init_device_mesh("cpu", (tp,))
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, Any] = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    for i in model.layers:
        p = f"layers.{i}."
        plan.update({
            p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
            p + "self_attn.v_proj": ColwiseParallel(),
            p + "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
            p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
            p + "mlp.down_proj": RowwiseParallel(output_layouts=seq),
        })
        if sp:
            plan.update({
                p + "input_layernorm": SequenceParallel(),
                p + "post_attention_layernorm": SequenceParallel(),
                p + "self_attn": PrepareModuleInput(input_layouts=(Shard(1), None),
                                               desired_input_layouts=(Replicate(), None)),
                p + "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                              desired_input_layouts=(Replicate(),)),
            })
    return parallelize_module(model, mesh, plan)


def _rank(rank: int, world: int, cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import loss_parallel

    from ..comm.ops import Traffic
    from ..config import ParallelConfig
    from ..dist.grid import Grid
    from ..model import build_model
    from ..parallel.parallelize import parallelize_parts
    from ..train.data import local_batch

    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    seed = 1234
    x, y = local_batch(0, seed, args.batch, cfg.seq_len, 0, 1, 4.0)
    pos = torch.arange(cfg.seq_len)
    scale = 1.0 / y.numel()
    sps = {"both": (False, True), "on": (True,), "off": (False,)}[args.sp]
    grid = Grid.from_config(ParallelConfig(tp=world), rank).connect(Traffic())
    steps: dict[str, Any] = {}
    first: dict[str, float] = {}
    for sp in sps:
        tag = "+sp" if sp else ""
        fpar = ParallelConfig(tp=world, sequence_parallel=sp, overlap=not args.no_overlap)
        fm = parallelize_parts(build_model(cfg, seed), grid, fpar)[0][0]
        dm = dtensor_model(cfg, seed, world, sp)

        def fived_step(fm=fm):
            loss = fm(x, pos, y)
            (loss * scale).backward()
            fm.zero_grad(set_to_none=True)
            return float(loss.detach())

        def dtensor_step(dm=dm):
            with loss_parallel():
                loss = dm(x, pos, y)
                (loss * scale).backward()
            dm.zero_grad(set_to_none=True)
            loss = loss.detach()
            return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

        steps["fived" + tag] = fived_step
        steps["dtensor" + tag] = dtensor_step
    times: dict[str, list[float]] = {k: [] for k in steps}
    last: dict[str, float] = {}
    for k, fn in steps.items():
        first[k] = fn()
    for r in range(args.warmup + args.reps):
        for k, fn in steps.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            fn()
            dt = last[k] = time.perf_counter() - t0
            if r >= args.warmup:
                times[k].append(dt)
        if rank == 0:
            label = "warmup" if r < args.warmup else f"rep {r - args.warmup + 1}/{args.reps}"
            say(f"  {label}: " + "  ".join(f"{k} {last[k] * 1e3:.1f} ms" for k in steps))
    return {"times": times, "first_loss": first}


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from ..config import ParallelConfig, preset, validate
    from ..dist.launch import run_local

    cfg = preset(args.model)
    validate(cfg, ParallelConfig(tp=args.tp, sequence_parallel=args.sp != "off"))
    if args.tp > cfg.kv_heads:
        print(f"fived bench tp: DTensor's ColwiseParallel cannot replicate kv heads; use --tp <= "
              f"{cfg.kv_heads} for {cfg.name}", file=sys.stderr)
        return 2
    print(f"fived bench tp — {cfg.name} (h{cfg.hidden}, {cfg.layers} layers, seq {cfg.seq_len}), "
          f"batch {args.batch}, tp={args.tp}, {args.reps} reps (+{args.warmup} warmup), "
          f"fwd+bwd per step; fived (overlap {'off' if args.no_overlap else 'on'}) vs DTensor "
          "parallelize_module", flush=True)
    t0 = time.perf_counter()
    out = run_local(_rank, args.tp, (cfg, args), timeout=600)
    times = out[0]["times"]
    # a step's time is the slowest rank's
    med = {k: statistics.median(max(o["times"][k][i] for o in out) for i in range(args.reps))
           for k in times}
    first = out[0]["first_loss"]
    print(f"\n{'variant':<10} {'fived ms':>10} {'DTensor ms':>11} {'fived/DTensor':>14} "
          f"{'loss fived':>11} {'loss DTensor':>13}")
    rows = []
    for tag in ("", "+sp"):
        if "fived" + tag not in med:
            continue
        f, d = med["fived" + tag], med["dtensor" + tag]
        rows.append({"variant": "tp" + tag, "fived_s": f, "dtensor_s": d, "ratio": f / d,
                     "loss_fived": first["fived" + tag], "loss_dtensor": first["dtensor" + tag]})
        print(f"{'tp' + tag:<10} {f * 1e3:>10.1f} {d * 1e3:>11.1f} {f / d:>13.2f}x "
              f"{first['fived' + tag]:>11.5f} {first['dtensor' + tag]:>13.5f}")
    print(f"(medians of {args.reps}; total {time.perf_counter() - t0:.1f} s)")
    if args.json:
        import json

        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
