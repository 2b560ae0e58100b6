"""fived's command line: train | grid | plan | ledger | bench | figures.

``fived train`` with no arguments trains the ``tiny`` model on the built-in corpus on 4 local
ranks it spawns itself; under ``torchrun`` it uses the launcher's ranks. ``fived bench NAME``
and ``fived figures NAME`` run ``fived.bench.NAME`` / ``fived.viz.NAME``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import replace

from ..config import DIMS, ConfigError, ParallelConfig, TrainConfig, load_toml, preset

EXAMPLES = """examples:
  fived train                                  # tiny model, 4 local ranks (dp=4), 50 steps
  fived train --dp 2 --steps 5 --metrics-out a.jsonl
  fived train --tp 2 --dp 2 --zero 1           # 2D layout on 4 ranks
  torchrun --nproc-per-node 8 -m fived train --model small --pp 2 --tp 2 --dp 2
  fived grid --tp 2 --pp 2 --dp 2 --gpus-per-node 4
  fived bench comm --nprocs 2 -b 1K -e 16M -f 4 --json
"""


def _layout_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("layout (world = pp·dp·ep·cp·tp)")
    for d, what in (("tp", "tensor"), ("cp", "context"), ("ep", "expert"), ("dp", "data"),
                    ("pp", "pipeline")):
        g.add_argument(f"--{d}", type=int, default=None, help=f"{what}-parallel degree")


def _parallel_flags(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("how the dimensions run")
    g.add_argument("--zero", type=int, default=None, choices=[0, 1, 2, 3], help="ZeRO stage")
    g.add_argument("--schedule", default=None, help="pipeline schedule: gpipe|1f1b|interleaved|zb-h1")
    g.add_argument("--virtual-stages", type=int, default=None, help="interleaved: stages per rank")
    g.add_argument("--micro-batches", type=int, default=None, help="micro-batches per step")
    g.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="shard norms/residual over tp along the sequence")
    g.add_argument("--recompute", default=None, help="activation recompute: none|selective|full")
    g.add_argument("--precision", default=None, help="fp32|bf16|fp16")
    g.add_argument("--grad-reduce-dtype", default=None, help="fp32|bf16")
    g.add_argument("--cp-mode", default=None, help="ring|ulysses")
    g.add_argument("--bucket-mb", type=float, default=None, help="DDP gradient bucket size (MB)")
    g.add_argument("--no-overlap", dest="overlap", action="store_false", default=None,
                   help="reduce gradients after backward instead of during it")
    g.add_argument("--pp-layers", default=None, help="layers per stage by hand, e.g. 3,5")
    g.add_argument("--order", default=None, help="grid order outermost..innermost, e.g. pp,dp,ep,cp,tp")


def build_configs(args: argparse.Namespace):
    """TOML first (if given), then every flag the user set on the command line."""
    if args.config:
        model, par, train = load_toml(args.config)
    else:
        model, par, train = preset("tiny"), ParallelConfig(), TrainConfig()
    if args.model:
        model = preset(args.model)
        train = replace(train, model=args.model)
    if getattr(args, "seq_len", None):
        model = replace(model, seq_len=args.seq_len)
    pk = {}
    for d in DIMS:
        if getattr(args, d) is not None:
            pk[d] = getattr(args, d)
    for k in ("zero", "schedule", "virtual_stages", "micro_batches", "sequence_parallel",
              "recompute", "precision", "grad_reduce_dtype", "cp_mode", "bucket_mb", "overlap"):
        v = getattr(args, k, None)
        if v is not None:
            pk[k] = v
    if getattr(args, "pp_layers", None):
        try:
            pk["pp_layers"] = tuple(int(x) for x in args.pp_layers.split(","))
        except ValueError:
            raise ConfigError([f"--pp-layers {args.pp_layers!r}: give integers like 3,5"]) from None
    if getattr(args, "order", None):
        pk["order"] = tuple(x.strip() for x in args.order.split(","))
    par = replace(par, **pk)
    tk = {}
    for k in ("steps", "global_batch", "lr", "seed", "metrics_out"):
        v = getattr(args, k, None)
        if v is not None:
            tk[k] = v
    train = replace(train, **tk)
    return model, par, train


def fill_dp(par: ParallelConfig, world: int, dp_given: bool) -> ParallelConfig:
    """Without --dp, data parallelism takes the ranks the other degrees leave."""
    if dp_given:
        return par
    rest = par.tp * par.cp * par.ep * par.pp
    return replace(par, dp=max(1, world // rest))


def cmd_train(args: argparse.Namespace) -> int:
    from ..dist.launch import RankFailure, run_local, torchrun_env

    model, par, train = build_configs(args)
    others = par.tp * par.cp * par.ep * par.pp
    env = torchrun_env()  # (rank, world, local_rank) under torchrun, else None
    if env:
        world = env[1]
    elif args.nprocs:
        world = args.nprocs
    elif args.dp is not None:
        world = par.world_size
    else:
        world = others * max(1, 4 // others)
    par = fill_dp(par, world, args.dp is not None)
    from ..train.trainer import check, measure_matmul_peak, train_rank

    if not env or env[0] == 0:  # under torchrun, rank 0 speaks
        print(f"fived train: {model.name} · {par.describe()} · {world} rank(s) · "
              f"{train.steps} steps · global batch {train.global_batch}×{model.seq_len} tokens",
              flush=True)
    check(model, par, train, world)
    if env:
        from ..dist.launch import run_torchrun

        # every rank has its own threads (or device): the aggregate peak is world × one rank's
        peak = measure_matmul_peak() * world if env[0] == 0 else 0.0
        run_torchrun(train_rank, (model, par, train, True, peak), args.timeout)
        return 0
    peak = measure_matmul_peak()
    print(f"measured matmul peak {peak / 1e9:.1f} GFLOP/s (MFU denominator); "
          f"starting {world} local rank(s) on gloo ...", flush=True)
    try:
        run_local(train_rank, world, (model, par, train, True, peak), timeout=args.timeout * 50,
                  collective_timeout=args.timeout)
    except RankFailure as e:
        print(f"fived train: rank {e.rank} failed — every rank was stopped.\n{e.detail}",
              file=sys.stderr)
        return 1
    if train.metrics_out:
        print(f"metrics: {train.metrics_out}")
    return 0


def cmd_grid(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..dist.grid import DERIVED, Grid

    par = ParallelConfig(**{d: getattr(args, d) or 1 for d in DIMS},
                         **({"order": tuple(args.order.split(","))} if args.order else {}))
    grid = Grid.from_config(par)
    gpn = args.gpus_per_node or (grid.world_size // args.nodes if args.nodes else 0)
    con = Console()
    t = Table(title=f"grid {par.describe()} — {grid.world_size} ranks, order "
                    f"{'·'.join(grid.order)} (outermost first)")
    t.add_column("rank", justify="right")
    if gpn:
        t.add_column("node", justify="right")
    for d in DIMS:
        t.add_column(d, justify="right")
    for g in ("tp", "cp", "ep", "dp", "pp", *DERIVED):
        t.add_column(f"{g} group")
    for r in range(grid.world_size):
        c = grid.coords(r)
        row = [str(r)] + ([str(r // gpn)] if gpn else []) + [str(c[d]) for d in DIMS]
        for g in ("tp", "cp", "ep", "dp", "pp", *DERIVED):
            m = grid.members(Grid.named_dims(g), r)
            row.append(",".join(map(str, m)) if len(m) > 1 else "-")
        t.add_row(*row)
    con.print(t)
    if gpn:
        for name in ("tp", "cp", "ep", "dp", "pp", *DERIVED):
            dims = Grid.named_dims(name)
            if grid.world_size > 1 and grid.crosses_node(dims, gpn):
                hot = name in ("tp", "cp", "cp_tp")
                tag = "[bold red]WARNING[/]" if hot else "note"
                con.print(f"{tag}: {name} groups cross a node boundary "
                          f"({gpn} GPUs per node)" + (" — tp and cp talk every layer and "
                                                       "belong inside a node" if hot else ""))
    return 0


def _dispatch(package: str, what: str, argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: fived {what} NAME [options]; NAME is a module of {package} "
              f"(e.g. fived {what} comm --help)")
        return 0
    name = argv[0].replace("-", "_")
    try:
        mod = importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{package}.{name}":
            raise  # a real import error inside the module: show it
        print(f"fived {what}: no {what} named {argv[0]!r} in this build", file=sys.stderr)
        return 2
    return int(mod.main(argv[1:]) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("bench", "figures"):
        pkg = "fived.bench" if argv[0] == "bench" else "fived.viz"
        return _dispatch(pkg, argv[0], argv[1:])
    if argv and argv[0] in ("plan", "ledger"):
        try:
            from ..ledger import cli as ledger_cli
        except ModuleNotFoundError:
            print(f"fived {argv[0]}: the planner is not built yet", file=sys.stderr)
            return 2
        try:
            return int(getattr(ledger_cli, f"main_{argv[0]}")(argv[1:]) or 0)
        except ConfigError as e:
            print(f"ConfigError: {e}", file=sys.stderr)
            return 2
    ap = argparse.ArgumentParser(
        prog="fived", description="Train transformers with data, tensor, pipeline, context and "
        "expert parallelism, and account for every byte.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", metavar="{train,grid,plan,ledger,bench,figures}")
    tr = sub.add_parser("train", help="train a model on local ranks or under torchrun",
                        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    tr.add_argument("--model", default=None, help="preset: tiny, tiny-moe, small, llama2-7b, ...")
    tr.add_argument("--config", default=None, help="TOML with [model] [parallel] [train]")
    _layout_flags(tr)
    _parallel_flags(tr)
    g = tr.add_argument_group("run")
    g.add_argument("--steps", type=int, default=None, help="optimizer steps (default 50)")
    g.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step, the same for every layout (default 16)")
    g.add_argument("--seq-len", type=int, default=None, help="override the model's seq_len")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--metrics-out", default=None, help="write one JSON line per step here")
    g.add_argument("--nprocs", type=int, default=None,
                   help="local ranks to spawn (default: 4, or the product of the degrees)")
    g.add_argument("--timeout", type=float, default=120.0,
                   help="collective timeout in seconds: a dead rank stops the others")
    gr = sub.add_parser("grid", help="print every rank's coordinates and groups")
    _layout_flags(gr)
    gr.add_argument("--nodes", type=int, default=0)
    gr.add_argument("--gpus-per-node", type=int, default=0)
    gr.add_argument("--order", default=None)
    sub.add_parser("plan", help="search layouts for a model on a cluster (fived plan --help)")
    sub.add_parser("ledger", help="memory/FLOPs/traffic breakdown of one layout")
    sub.add_parser("bench", help="benchmarks: comm, ddp, zero, tp, pp, cp, ep")
    sub.add_parser("figures", help="figures: schedule, ...")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "train":
            return cmd_train(args)
        if args.cmd == "grid":
            return cmd_grid(args)
    except ConfigError as e:
        print(f"ConfigError: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
