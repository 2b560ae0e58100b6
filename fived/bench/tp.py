"""``fived bench tp``: fived's tensor (+ sequence) parallelism against PyTorch's DTensor.

The same Llama-style model (the one-rank build of ``fived.model``) is parallelized two ways on
the same ranks in one run:

* fived: ``apply_tp`` (+ ``sequence_parallel``) — column/row linears on ``fived.comm``,
  vocab-parallel embedding and cross-entropy;
* DTensor: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` (+
  ``SequenceParallel`` and ``PrepareModuleInput`` for SP), a ``RowwiseParallel`` embedding and a
  ``ColwiseParallel`` head whose vocab-sharded logits go to ``loss_parallel`` cross-entropy —
  the torchtitan recipe.

One timed step = forward + backward of the mean token loss, gradient clipping and AdamW: fived's
engine (its flat AdamW) against torch's fastest AdamW for DTensors (``fused=True``) with the
same global-norm clipping (``harness.clip_grads``). Before anything is timed both sides run
batch 0 and the bench asserts equal losses and gradients (fived's piece of each DTensor
gradient, relative gap < 1e-4). The repetitions interleave the variants and the order flips
every repetition so load drifts hit all of them alike; the table reports medians (the slowest
rank's time) and fived / DTensor, and the optimizer's time (clip + AdamW) of both sides.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

from ..ui import flags
from ..ui.args import Parser
from . import schema

if TYPE_CHECKING:  # torch is imported where it runs: --help stays fast
    import torch

VARIANTS = ("fived", "dtensor")


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = Parser(prog="fived bench tp", description=__doc__.split("\n")[0])
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
    """The one-rank fived model parallelized by ``torch.distributed.tensor.parallel``. Not for
    ``qk_norm`` (the plan has no rule for the q/k norm gains, whose gradients each rank computes
    from its own heads only; fived's ``apply_tp`` sums them over tp) nor ``qkv_bias`` (never
    compared with the peer): a ConfigError."""
    from ..config import ConfigError

    bad = [f for f in ("qk_norm", "qkv_bias") if getattr(cfg, f)]
    if bad:
        raise ConfigError([f"fived bench tp: the DTensor peer is built for Llama-shaped "
                           f"attention; {', '.join(bad)} is not supported there"])
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


def _local_piece(full: torch.Tensor, pl: Any) -> torch.Tensor:
    """fived's piece of a full tensor: chunk ``index`` of ``parts`` along ``dim``."""
    return full.chunk(pl.parts, pl.dim)[pl.index] if pl.parts > 1 else full


def _rank(rank: int, world: int, cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import loss_parallel

    from ..comm.ops import Traffic
    from ..config import ParallelConfig, TrainConfig
    from ..model import build_model
    from ..parallel.parallelize import parallelize
    from ..ranks.grid import Grid
    from ..train.data import local_batch
    from .harness import clip_grads, fastest_adamw, state_bytes_torch

    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    seed = 1234
    train = TrainConfig(seed=seed)
    batches = [local_batch(i, seed, args.batch, cfg.seq_len, 0, 1, 4.0)
               for i in range(args.warmup + args.reps + 1)]
    pos = torch.arange(cfg.seq_len)
    scale = 1.0 / batches[0][1].numel()
    sps = {"both": (False, True), "on": (True,), "off": (False,)}[args.sp]
    traffic = Traffic()
    grid = Grid.from_config(ParallelConfig(tp=world), rank).connect(traffic)
    steps: dict[str, Any] = {}
    info: dict[str, dict[str, Any]] = {}
    for sp in sps:
        tag = "+sp" if sp else ""
        fpar = ParallelConfig(tp=world, sequence_parallel=sp, overlap=not args.no_overlap)
        laid = parallelize(build_model(cfg, seed), grid, fpar, train)
        fm, engine = laid.model, laid.engine
        dm = dtensor_model(cfg, seed, world, sp)
        dparams = list(dm.parameters())
        dopt = fastest_adamw(dparams, train)
        fk, dk = "fived" + tag, "dtensor" + tag
        info[fk] = {"opt": 0.0, "sent": []}
        info[dk] = {"opt": 0.0, "sent": []}

        def fived_fwd_bwd(i: int, fm=fm, engine=engine) -> float:
            x, y = batches[i]
            engine.zero_grad()
            engine.set_last_micro(True)
            loss = fm(x, pos, y)
            (loss * scale).backward()
            engine.finish()
            return float(loss.detach())

        def dtensor_fwd_bwd(i: int, dm=dm, dopt=dopt) -> float:
            x, y = batches[i]
            dopt.zero_grad(set_to_none=True)
            with loss_parallel():
                loss = dm(x, pos, y)
                (loss * scale).backward()
            loss = loss.detach()
            return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)

        def fived_step(i: int, fwd_bwd=fived_fwd_bwd, engine=engine, key=fk) -> float:
            traffic.reset()
            loss = fwd_bwd(i)
            t0 = time.perf_counter()
            engine.clip(train.grad_clip)
            engine.step(1e-3)
            info[key]["opt"] += time.perf_counter() - t0
            info[key]["sent"].append(sum(traffic.bytes_by_dim().values()))
            return loss

        def dtensor_step(i: int, fwd_bwd=dtensor_fwd_bwd, dparams=dparams, dopt=dopt,
                         key=dk) -> float:
            loss = fwd_bwd(i)
            t0 = time.perf_counter()
            clip_grads(dparams, train.grad_clip)
            dopt.step()
            info[key]["opt"] += time.perf_counter() - t0
            return loss

        # the same work: equal losses and gradients on batch 0, before anything is timed
        lf, ld = fived_fwd_bwd(0), dtensor_fwd_bwd(0)
        assert abs(lf - ld) <= 1e-4 * abs(ld), f"tp{tag}: loss fived {lf} != DTensor {ld}"
        fg = engine.full_grads()
        gap = 0.0
        for name, p in dm.named_parameters():
            full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            ref = _local_piece(full, laid.placements[name])
            gap = max(gap, float((fg[name] - ref).norm() / ref.norm().clamp_min(1e-30)))
        assert gap < 1e-4, f"tp{tag}: gradients differ from DTensor's (relative {gap:.2e})"
        info[fk].update(loss=lf, grad_gap=gap)
        info[dk].update(loss=ld, grad_gap=gap)
        info[fk]["state"] = engine.memory()
        info[dk]["state_fn"] = (lambda dm=dm, dopt=dopt: state_bytes_torch(dm, dopt))
        steps[fk], steps[dk] = fived_step, dtensor_step
    gaps = ", ".join(f"{k} gap {v['grad_gap']:.1e}" for k, v in info.items() if "fived" in k)
    say(f"  checked: equal first loss and gradients ({gaps})")
    times: dict[str, list[float]] = {k: [] for k in steps}
    opts: dict[str, list[float]] = {k: [] for k in steps}
    cpus: dict[str, list[float]] = {k: [] for k in steps}
    last: dict[str, float] = {}
    keys = list(steps)
    for r in range(args.warmup + args.reps):
        for k in (keys if r % 2 == 0 else keys[::-1]):  # the order flips every repetition
            dist.barrier()
            info[k]["opt"] = 0.0
            t0, c0 = time.perf_counter(), time.process_time()
            steps[k](r + 1)
            dt = last[k] = time.perf_counter() - t0
            if r >= args.warmup:
                times[k].append(dt)
                opts[k].append(info[k]["opt"])
                cpus[k].append(time.process_time() - c0)
        if rank == 0:
            label = "warmup" if r < args.warmup else f"rep {r - args.warmup + 1}/{args.reps}"
            say(f"  {label}: " + "  ".join(f"{k} {last[k] * 1e3:.1f} ms" for k in steps))
    out = {}
    for k in steps:
        st = info[k].get("state")
        out[k] = {"times": times[k], "opts": opts[k], "cpus": cpus[k], "loss": info[k]["loss"],
                  "grad_gap": info[k]["grad_gap"],
                  "sent": max(info[k]["sent"]) if info[k]["sent"] else None,
                  "state": (st["params"] + st["grads"] + st["master"] + st["optimizer"]) if st
                  else info[k]["state_fn"]()}
    return out


@schema.json_stdout
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    from ..config import ParallelConfig, preset, validate
    from ..ranks.launch import run_local, threads_per_rank

    cfg = preset(args.model)
    validate(cfg, ParallelConfig(tp=args.tp, sequence_parallel=args.sp != "off"))
    if args.tp > cfg.kv_heads:
        print(f"fived bench tp: DTensor's ColwiseParallel cannot replicate kv heads; use --tp <= "
              f"{cfg.kv_heads} for {cfg.name}", file=sys.stderr)
        return 2
    from ..ui.report import fold

    print(fold(f"fived bench tp — {cfg.name} (h{cfg.hidden}, {cfg.layers} layers, seq "
               f"{cfg.seq_len}), batch {args.batch}, tp={args.tp}, {args.reps} reps "
               f"(+{args.warmup} warmup), fwd+bwd+clip+AdamW per step; fived (overlap "
               f"{'off' if args.no_overlap else 'on'}) vs DTensor parallelize_module (fused "
               "AdamW)", indent="  "), flush=True)
    t0 = time.perf_counter()
    out = run_local(_rank, args.tp, (cfg, args), timeout=600)

    def med(k: str, field: str) -> float:  # a step's time is the slowest rank's
        return statistics.median(max(o[k][field][i] for o in out) for i in range(args.reps))

    rows = []
    for tag in ("", "+sp"):
        for k, impl in (("fived" + tag, "fived"), ("dtensor" + tag, "DTensor")):
            if k not in out[0]:
                continue
            sent = [o[k]["sent"] for o in out if o[k]["sent"] is not None]
            rows.append(schema.row("tp" + tag, impl, med(k, "times"), peer=impl == "DTensor",
                                   state_bytes=out[0][k]["state"],
                                   bytes_sent=max(sent) if sent else None,
                                   optimizer_s=med(k, "opts"), first_loss=out[0][k]["loss"],
                                   times_s=[max(o[k]["times"][i] for o in out)
                                            for i in range(args.reps)],
                                   cpu_s=statistics.median(sum(o[k]["cpus"][i] for o in out)
                                                           for i in range(args.reps)),
                                   grad_rel_gap=out[0][k]["grad_gap"]))
    doc = schema.document("tp", argv, rows, settings=vars(args),
                          extra={"model": cfg.name, "tp": args.tp},
                          mach=schema.machine(threads_per_rank=threads_per_rank(args.tp)))
    print(f"\n{'variant':<7} {'fived ms':>9} {'DTensor ms':>11} {'fived/DTensor':>14} "
          f"{'optim f/D ms':>13} {'first loss':>11} {'grad gap':>9}")
    by = {(r["variant"], r["implementation"]): r for r in doc["rows"]}
    for v in dict.fromkeys(r["variant"] for r in doc["rows"]):
        f, d = by[(v, "fived")], by[(v, "DTensor")]
        print(f"{v:<7} {f['step_s'] * 1e3:>9.1f} {d['step_s'] * 1e3:>11.1f} "
              f"{f['ratio']:>13.2f}x {f['optimizer_s'] * 1e3:>6.1f}/{d['optimizer_s'] * 1e3:<6.1f}"
              f" {f['extra']['first_loss']:>11.4f} {f['extra']['grad_rel_gap']:>9.1e}")
    print(f"(medians of {args.reps}, order alternating; total {time.perf_counter() - t0:.1f} s)")
    if args.json:
        schema.emit(doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
