"""``fived bench cp``: ring attention against Ulysses against all-gathering K/V, on one shape.

Every mode runs forward + backward of the causal attention core on the same zigzag-sharded
q/k/v over ``--cp`` local gloo ranks; the table gives the median step time (max over ranks),
the bytes one rank sent per step (measured by ``fived.comm`` and the formula of
``fived.parallel.context.traffic_per_layer``), the activation bytes the core saved per rank and
the one-rank time of the same full-sequence attention. Times on a shared CPU are noise; the
ratios and the bytes are the result.

    fived bench cp                       # cp 4, b 1, seq 2048, 8 heads, 2 kv heads, d 32
    fived bench cp --cp 2 --seq 4096 --iters 5 --json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from ..ui import flags
from ..ui.args import Parser
from . import schema

MODES = ("ring", "ulysses", "allgather", "ring-contiguous")
DEFAULT_MODES = ("ring", "ulysses", "allgather", "ring-contiguous")


def _bench_rank(rank: int, world: int, a: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from ..comm.ops import Traffic
    from ..parallel import context
    from ..ranks.grid import DimGroup
    from ..train.activations import SavedTensors

    traffic = Traffic()
    group = DimGroup("cp", tuple(range(world)), rank, dist.group.WORLD, traffic)
    gen = torch.Generator().manual_seed(0)
    b, s, h, g, d = a["batch"], a["seq"], a["heads"], a["kv_heads"], a["head_dim"]
    full = [torch.randn(b, s, x, d, generator=gen) for x in (h, g, g)]
    dfull = torch.randn(b, s, h, d, generator=gen)
    out: dict[str, Any] = {}
    outputs: dict[str, tuple] = {}
    for mode in a["modes"]:
        base, _, layout = mode.partition("-")
        layout = layout or "zigzag"
        fn = context.MODES[base]
        pos = context.shard_positions(s, world, rank, layout)
        q, k, v = (x[:, pos].contiguous() for x in full)
        do = dfull[:, pos].contiguous()
        times, sent, saved_bytes = [], 0.0, 0
        for it in range(a["warmup"] + a["iters"]):
            ql, kl, vl = (t.clone().requires_grad_(True) for t in (q, k, v))
            dist.barrier()
            traffic.reset()
            t0 = time.perf_counter()
            stats = context.AttentionStats()  # ring only: the other modes count nothing
            kw = {"stats": stats} if base == "ring" else {}
            with SavedTensors() as saved:
                o = fn(ql, kl, vl, group, layout, **kw)
            fwd_flops = stats.flops
            o.backward(do)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
            if it >= a["warmup"]:
                times.append(float(dt))
            sent = sum(r.bytes for r in traffic.records.values())
            saved_bytes = saved.bytes
        outputs[mode] = (layout, o.detach(), ql.grad)
        per = context.traffic_per_layer(base, b, s // world, h, g, d, world)
        flops = torch.zeros(world, dtype=torch.float64)
        flops[rank] = fwd_flops
        dist.all_reduce(flops)
        out[mode] = {"seconds": statistics.median(times), "bytes": sent,
                     "formula": per["forward"] + per["backward"], "saved": saved_bytes,
                     "flops_per_rank": flops.tolist()}
        if rank == 0:
            print(f"  {mode:<16} {out[mode]['seconds'] * 1e3:9.2f} ms   "
                  f"{sent / 2**20:8.3f} MiB sent/rank", flush=True)
    # the same attention: every mode of a layout gives the same output and dq as the first
    ref: dict[str, tuple] = {}
    for mode, (layout, o, dq) in outputs.items():
        if layout not in ref:
            ref[layout] = (mode, o, dq)
            continue
        m0, o0, dq0 = ref[layout]
        for name, x, x0 in (("output", o, o0), ("dq", dq, dq0)):
            gap = float((x - x0).norm() / x0.norm().clamp_min(1e-30))
            assert gap < 1e-4, f"rank {rank}: {mode} {name} differs from {m0}'s ({gap:.1e})"
    return out


def _one_rank(a: dict[str, Any]) -> tuple[float, int]:
    import torch

    from ..model import layers
    from ..train.activations import SavedTensors

    b, s, h, g, d = a["batch"], a["seq"], a["heads"], a["kv_heads"], a["head_dim"]
    q, k, v = (torch.randn(b, s, x, d, requires_grad=True) for x in (h, g, g))
    do = torch.randn(b, s, h, d)
    times = []
    for it in range(a["warmup"] + a["iters"]):
        t0 = time.perf_counter()
        with SavedTensors() as saved:
            o = layers.causal_attention(q, k, v)
        o.backward(do)
        if it >= a["warmup"]:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), saved.bytes


def _imbalance(flops: list[float]) -> str:
    if not any(flops):
        return "-"
    return f"{max(flops) / min(flops):.3f}" if min(flops) else "inf"


def parse(argv: list[str]) -> argparse.Namespace:
    ap = Parser(prog="fived bench cp", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_flag(ap, "cp", default=4, help="context-parallel ranks (local gloo processes)")
    ap.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    ap.add_argument("--seq", type=int, default=2048, help="full sequence length")
    ap.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    ap.add_argument("--kv-heads", type=int, default=2, help="kv heads, GQA (default 2)")
    ap.add_argument("--head-dim", type=int, default=32, help="default 32")
    ap.add_argument("--iters", type=int, default=5,
                    help="timed forward+backward iterations per mode; median (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations first (default 1)")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES),
                    help="comma list of ring, ulysses, allgather, ring-contiguous (no zigzag)")
    ap.add_argument("--json", action="store_true", help="print the fived.bench JSON document "
                    "(docs/benchmarks.md) as the last line")
    return flags.parse(ap, argv)


@schema.json_stdout
def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..ranks.launch import RankFailure, run_local
    from ..train.metrics import human_bytes

    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    a = {"batch": args.batch, "seq": args.seq, "heads": args.heads, "kv_heads": args.kv_heads,
         "head_dim": args.head_dim, "iters": args.iters, "warmup": args.warmup,
         "modes": [m.strip() for m in args.modes.split(",") if m.strip()]}
    bad = [m for m in a["modes"] if m not in MODES]
    problems = bad and [f"--modes: unknown {bad}; choose from {', '.join(MODES)}"] or []
    if args.seq % (2 * args.cp):
        problems.append(f"--seq {args.seq} is not divisible by 2·cp = {2 * args.cp}")
    if args.heads % args.kv_heads:
        problems.append(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    if "ulysses" in a["modes"] and args.heads % args.cp:
        problems.append(f"ulysses: --heads {args.heads} not divisible by --cp {args.cp}")
    if problems:
        print("fived bench cp: " + "; ".join(problems), file=sys.stderr)
        return 2
    con = Console(width=120)
    con.print(f"[bold]fived bench cp[/]: cp={args.cp} · batch {args.batch} · seq {args.seq} "
              f"({args.seq // args.cp}/rank) · heads {args.heads} · kv heads {args.kv_heads} · "
              f"head_dim {args.head_dim} · fp32 · {args.warmup}+{args.iters} iters of fwd+bwd",
              highlight=False)
    t0 = time.perf_counter()
    one, one_saved = _one_rank(a)
    con.print(f"  {'1 rank':<16} {one * 1e3:9.2f} ms   (full sequence, causal_attention)")
    try:
        res = run_local(_bench_rank, args.cp, (a,), timeout=600, collective_timeout=120)[0]
    except RankFailure as e:
        print(f"fived bench cp: rank {e.rank} failed\n{e.detail}", file=sys.stderr)
        return 1
    table = Table(title=f"context-parallel attention, cp={args.cp}, fwd+bwd per step "
                        f"({time.perf_counter() - t0:.1f} s)")
    for col in ("mode", "step (ms)", "vs ring", "vs 1 rank", "sent/rank", "formula",
                "saved/rank", "ring FLOPs max/min"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    ring_t = res.get("ring", {}).get("seconds")
    for mode, r in res.items():
        table.add_row(mode, f"{r['seconds'] * 1e3:.2f}",
                      f"{r['seconds'] / ring_t:.2f}×" if ring_t else "-",
                      f"{r['seconds'] / one:.2f}×", human_bytes(r["bytes"]),
                      "= formula" if r["bytes"] == r["formula"] else human_bytes(r["formula"]),
                      human_bytes(r["saved"]), _imbalance(r["flops_per_rank"]))
    table.add_row("1 rank", f"{one * 1e3:.2f}", "", "1.00×", "0 B", "", human_bytes(one_saved))
    con.print(table)
    bal = [m for m in ("ring", "ring-contiguous") if m in res]
    if bal:
        t2 = Table(title="balance: forward attention FLOPs per cp rank (GFLOP, executed blocks)")
        t2.add_column("layout")
        for r in range(args.cp):
            t2.add_column(f"rank {r}", justify="right")
        t2.add_column("max/min", justify="right")
        for m in bal:
            f = res[m]["flops_per_rank"]
            t2.add_row("zigzag" if m == "ring" else "contiguous", *(f"{x / 1e9:.3f}" for x in f),
                       _imbalance(f))
        con.print(t2)
    if args.json:
        schema.emit(_document(argv, args, res, one, one_saved))
    return 0


def _document(argv: list[str], args: argparse.Namespace, res: dict, one: float,
              one_saved: int) -> dict:
    """``fived.bench`` rows: variant "attention", one implementation per mode; the peer is
    ``allgather`` (all-gathering K/V: the rotate method torch's ``context_parallel`` uses by
    default) when it ran; bytes_sent = measured bytes one rank sent per step."""
    peer = "allgather" if "allgather" in res else None
    rows = [schema.row("attention", mode, r["seconds"], peer=mode == peer, bytes_sent=r["bytes"],
                       formula_bytes=r["formula"], saved_bytes=r["saved"],
                       flops_per_rank=r["flops_per_rank"]) for mode, r in res.items()]
    rows.append(schema.row("attention 1 rank", "one rank", one, saved_bytes=one_saved))
    return schema.document("cp", argv, rows, settings=vars(args),
                           extra={"one_rank_seconds": one, "peer": peer})


if __name__ == "__main__":
    sys.exit(main())
