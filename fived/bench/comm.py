"""``fived bench comm``: an nccl-tests-style sweep of every collective, backend and ring.

    fived bench comm --nprocs 4 -b 1K -e 16M -f 2 --iters 20 --warmup 5 \\
        [--ops all_reduce,all_gather,...] [--impl backend,ring] [--dtype float32] [--json] [--out F]

Spawns ``--nprocs`` local ranks (``fived.ranks.launch.run_local``) unless it runs under ``torchrun``,
sweeps the sizes for each (collective, implementation), and prints, per collective, nccl-tests'
columns (size, count, type, time, algbw, busbw) for each implementation, then the alpha-beta fit
per collective. ``--json`` prints the result document on stdout (the human output goes to stderr)
and ``--out FILE.json`` saves it: the ``fived.bench`` document (``fived.bench.schema``,
docs/benchmarks.md) whose rows' ``extra`` hold the sweep's rows (docs/comm.md).
Definitions: ``fived.comm.bench``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Any

# torch is imported only after the header is printed: importing it takes seconds.
from ..comm.bench import (
    BENCH_OPS,
    DTYPES,
    IMPLS,
    RING_OPS,
    Row,
    canonical_op,
    fit_rows,
    format_size,
    parse_size,
    plan,
    result_dict,
    size_sweep,
)
from ..comm.volume import busbw_factor
from ..ui.args import Parser
from . import schema


@dataclass
class Settings:
    sizes: list[int]
    pairs: list[tuple[str, str]]
    dtype: str
    iters: int
    warmup: int
    json: bool
    progress: bool
    cpu: bool = False  # --device cpu: gloo on CPU even when a GPU is visible


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="fived bench comm",
        description="Sweep collectives over sizes like nccl-tests: time, algbw, busbw per size and "
        "an alpha-beta fit per collective, for the backend's collectives and fived's ring.",
        epilog="example: fived bench comm --nprocs 4 -b 1K -e 16M -f 2 --impl backend,ring --json",
    )
    ap.add_argument("--nprocs", "-n", type=int, default=2,
                    help="local ranks to spawn (ignored under torchrun; default 2)")
    ap.add_argument("-b", "--minbytes", default="1K", help="smallest size (default 1K)")
    ap.add_argument("-e", "--maxbytes", default="16M", help="largest size (default 16M)")
    ap.add_argument("-f", "--stepfactor", type=float, default=2.0,
                    help="multiply the size by this each step (default 2)")
    ap.add_argument("--iters", type=int, default=20, help="timed iterations per size (default 20)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed iterations first (default 5)")
    ap.add_argument("--ops", default=",".join(BENCH_OPS),
                    help=f"comma-separated collectives (default all: {','.join(BENCH_OPS)})")
    ap.add_argument("--impl", default=",".join(IMPLS),
                    help="backend (the process group's collective), ring (fived.comm.ring, built "
                    f"from send/recv; exists for {','.join(RING_OPS)}); default both")
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu"],
                    help="cpu forces gloo on CPU even when a GPU is visible")
    ap.add_argument("--json", action="store_true",
                    help="print the result as JSON on stdout (tables go to stderr)")
    ap.add_argument("--out", default=None, help="also write the JSON result to this file")
    ap.add_argument("--markdown", action="store_true",
                    help="also print a Markdown summary (busbw per size, alpha, beta) for docs")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="collective timeout in seconds: a dead rank stops the others")
    ap.add_argument("--no-progress", dest="progress", action="store_false",
                    help="no progress bar while sweeping")
    return ap


def _settings(args: argparse.Namespace) -> Settings:
    ops_ = [canonical_op(o) for o in args.ops.split(",") if o.strip()]
    impls = [i.strip() for i in args.impl.split(",") if i.strip()]
    for i in impls:
        if i not in IMPLS:
            raise ValueError(f"unknown implementation {i!r}; choose from {', '.join(IMPLS)}")
    pairs = plan(list(dict.fromkeys(ops_)), impls)
    if not pairs:
        raise ValueError(f"nothing to run: the ring exists only for {', '.join(RING_OPS)}")
    if args.iters < 1 or args.warmup < 0:
        raise ValueError("need --iters >= 1 and --warmup >= 0")
    sizes = size_sweep(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    return Settings(sizes, pairs, args.dtype, args.iters, args.warmup, args.json, args.progress,
                    args.device == "cpu")


def _console(json_mode: bool):
    from rich.console import Console

    # 80 columns, a terminal's or a log's (fived.ui.report.WIDTH): the tables are built to fit
    return Console(stderr=json_mode, highlight=False, width=80)


# ---------------------------------------------------------------------------------- every rank
def rank_main(rank: int, world: int, cfg: Settings) -> dict[str, Any] | None:
    """One rank's sweep; rank 0 shows progress and returns the result document."""
    import torch

    from ..comm.bench import sweep
    from ..comm.ops import Traffic
    from ..config import ParallelConfig
    from ..ranks.grid import Grid
    from ..ranks.launch import device_and_backend

    device, backend = device_and_backend(prefer_cpu=cfg.cpu)
    traffic = Traffic()
    grid = Grid.from_config(ParallelConfig(dp=world), rank).connect(traffic)
    total = len(cfg.pairs) * len(cfg.sizes)
    on_point, progress = None, None
    if rank == 0 and cfg.progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=_console(cfg.json), transient=True)
        task = progress.add_task("sweeping", total=total)
        progress.start()

        done = [0]

        def on_point(row: Row) -> None:
            progress.update(task, advance=1, description=(
                f"{row.op:<14} {row.impl:<7} {format_size(row.size_bytes):>5}: "
                f"{row.busbw_GBps:7.3f} GB/s busbw"))
            done[0] += 1
            if not progress.console.is_terminal and done[0] % len(cfg.sizes) == 0:
                # a log, not a terminal: no bar is drawn, so say when each collective is done
                progress.console.print(f"[{done[0]}/{total}] {row.op}/{row.impl} done: "
                                       f"{row.busbw_GBps:.3f} GB/s busbw at "
                                       f"{format_size(row.size_bytes)}")
    try:
        rows = sweep(grid["dp"], traffic, cfg.pairs, cfg.sizes, cfg.dtype, cfg.iters, cfg.warmup,
                     device, on_point)
    finally:
        if progress is not None:
            progress.stop()
    if rank != 0:
        return None
    meta = {
        "backend": backend, "device": device.type, "dtype": cfg.dtype, "iters": cfg.iters,
        "warmup": cfg.warmup, "timing": "median over iters of the slowest rank, barrier before each",
        "sizes": cfg.sizes, "ops": list(dict.fromkeys(op for op, _ in cfg.pairs)),
        "impls": list(dict.fromkeys(impl for _, impl in cfg.pairs)),
        "host": platform.node(), "cpus": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "threads_per_rank": torch.get_num_threads(),
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return result_dict(rows, world, meta)


# ---------------------------------------------------------------------------------- printing
def _num(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if x >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def print_report(doc: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    rows = [Row(**r) for r in doc["rows"]]
    n = doc["world"]
    impls = doc["impls"]
    for op in doc["ops"]:
        mine = [r for r in rows if r.op == op]
        have = [i for i in impls if any(r.impl == i for r in mine)]
        dtype = mine[0].dtype if mine else doc.get("dtype", "")
        t = Table(title=f"{op} · {n} ranks · {doc['backend']} · {dtype} · busbw = algbw × "
                        f"{busbw_factor('send' if op == 'sendrecv' else op, n):.3g}; time in "
                        "µs, bandwidth in GB/s", title_justify="left")
        t.add_column("size (B)", justify="right", no_wrap=True)
        for impl in have:
            for c in ("time", "algbw", "busbw"):
                t.add_column(f"{impl}\n{c}", justify="right", no_wrap=True)
        for size in sorted({r.size_bytes for r in mine}):
            at = {r.impl: r for r in mine if r.size_bytes == size}
            cells = [str(size)]
            for impl in have:
                r = at.get(impl)
                cells += ([_num(r.time_us, 1), _num(r.algbw_GBps), _num(r.busbw_GBps)] if r
                          else ["-", "-", "-"])
            t.add_row(*cells)
        console.print(t)
    s = Table(title="alpha-beta fit: time = alpha + bus_bytes / beta (bus_bytes = "
                    "volume.bytes_sent, weighted least squares); alpha in µs, beta and busbw "
                    "in GB/s", title_justify="left")
    for c in ("collective", "impl", "alpha", "beta", "max err", "busbw at", "largest"):
        s.add_column(c, justify="right" if c not in ("collective", "impl") else "left",
                     no_wrap=True)
    for impl, fits in doc["fits_by_impl"].items():
        for op, f in fits.items():
            last = max((r for r in rows if r.op == op and r.impl == impl), key=lambda r: r.size_bytes)
            s.add_row(op, impl, _num(f["alpha_us"], 1), _num(f["beta_GBps"]),
                      f"{100 * f['max_rel_err']:.0f}%", _num(last.busbw_GBps),
                      format_size(last.size_bytes))
    console.print(s)


def markdown_summary(doc: dict[str, Any], columns: int = 6) -> str:
    """busbw (GB/s) at up to ``columns`` sizes (always the largest) and the fit, one row per
    (collective, impl) — the table docs/comm.md shows."""
    sizes = sorted({r["size_bytes"] for r in doc["rows"]})
    step = max(1, math.ceil((len(sizes) - 1) / max(columns - 1, 1)))
    pick = sorted(set(sizes[::-1][::step][:columns]))
    head = ["collective", "impl"] + [format_size(x) for x in pick] + ["alpha (us)", "beta (GB/s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    at = {(r["op"], r["impl"], r["size_bytes"]): r for r in doc["rows"]}
    fits_by_impl = doc["fits_by_impl"]
    for op in doc["ops"]:
        for impl in (i for i in doc["impls"] if op in fits_by_impl.get(i, {})):
            f = fits_by_impl[impl][op]
            cells = [op, impl] + [_num(at[(op, impl, x)]["busbw_GBps"]) if (op, impl, x) in at
                                  else "-" for x in pick]
            cells += [_num(f["alpha_us"], 0), _num(f["beta_GBps"])]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- entry point
@schema.json_stdout
def main(argv: list[str]) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        cfg = _settings(args)
    except ValueError as e:
        print(f"fived bench comm: {e}", file=sys.stderr)
        return 2
    con = _console(args.json)
    from ..ranks import launch  # torch is imported when a rank needs it

    env = launch.torchrun_env()  # (rank, world, local_rank) under torchrun, else None
    torchrun = env is not None
    world = env[1] if env else args.nprocs
    if world < 2:
        print("fived bench comm: needs at least 2 ranks (--nprocs 2)", file=sys.stderr)
        return 2
    quiet_rank = env is not None and env[0] != 0
    if quiet_rank:
        cfg.progress = False
    else:
        from ..ui.report import fold, header

        con.print(header([f"fived bench comm · {world} ranks "
                          f"({'torchrun' if torchrun else 'local'})", cfg.dtype,
                          f"{format_size(cfg.sizes[0])}..{format_size(cfg.sizes[-1])} "
                          f"×{args.stepfactor:g} ({len(cfg.sizes)} sizes)",
                          f"{cfg.iters} iters + {cfg.warmup} warm-up"]), markup=False)
        con.print(fold("collectives: " + ", ".join(f"{o}/{i}" for o, i in cfg.pairs),
                       indent="  "), markup=False)
    if env:
        if env[0] == 0:
            dev, backend = launch.device_and_backend(cfg.cpu, env[2])
            con.print(f"backend {backend} on {dev.type}; sweeping ...")
        doc = launch.run_torchrun(rank_main, (cfg,), args.timeout, prefer_cpu=cfg.cpu)
        if env[0] != 0:
            return 0
    else:
        _, backend = launch.device_and_backend(cfg.cpu)
        con.print(f"backend {backend}; spawning {world} local ranks "
                  f"({launch.threads_per_rank(world)} thread(s) each) ...")
        try:
            doc = launch.run_local(rank_main, world, (cfg,), timeout=max(600.0, 100 * args.timeout),
                                   collective_timeout=args.timeout, prefer_cpu=cfg.cpu)[0]
        except launch.RankFailure as e:
            print(f"fived bench comm: rank {e.rank} failed — every rank was stopped.\n{e.detail}",
                  file=sys.stderr)
            return 1
    doc["command"] = "fived bench comm " + " ".join(argv)
    print_report(doc, con)
    if args.markdown:
        con.print(markdown_summary(doc), markup=False, highlight=False, soft_wrap=True)
    from .schema import comm_document

    text = json.dumps(comm_document(doc), indent=1)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
        con.print(f"wrote {args.out}")
    if args.json:
        schema.emit_text(text)
    return 0


__all__ = ["main", "build_parser", "rank_main", "print_report", "markdown_summary", "fit_rows"]
