"""``fived grid``: every rank's coordinates and process groups, and node-boundary warnings."""

from __future__ import annotations

import argparse

from ..config import DIMS, ConfigError, check_count, check_values, fill_dp, hybrid_problems
from ..ui import flags, report
from ..ui.args import Parser


def parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog="fived grid", description="Print every rank's coordinate in each dimension and "
        "the ranks of its groups; warn when a group crosses a node boundary.",
        epilog="examples:\n  fived grid --tp 2 --pp 2 --dp 2 --gpus-per-node 4\n"
               "  fived grid --tp 4 --dp 2 --gpus-per-node 2 --wide\n"
               "  fived grid --dp-shard 4 --dp-replicate 2 --gpus-per-node 4   (hybrid sharding)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_config_flags(ap, groups=("layout",),
                           only=("tp", "cp", "ep", "dp", "pp", "order", "dp_shard",
                                 "dp_replicate"))
    g = ap.add_argument_group("cluster and output")
    g.add_argument("--nodes", type=int, default=None, metavar="N",
                   help="nodes the ranks are spread over (default: not shown)")
    g.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                   help="devices per node; shows each rank's node (default: not shown)")
    g.add_argument("--wide", action="store_true",
                   help="every coordinate and every group, also the derived ones (dense, expert, "
                        "batch)")
    g.add_argument("--json", action="store_true", help="print one JSON document instead")
    return ap


def main(argv: list[str]) -> int:
    from ..ranks.grid import DERIVED, HYBRID_GROUPS, Grid

    args = parser().parse_args(argv)
    res = flags.configs(args)
    for flag, v in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
        if v is not None:
            check_count(flag, v)
    world = args.nodes * args.gpus_per_node if args.nodes and args.gpus_per_node else None
    problems = check_values(None, res.par, None)
    if problems:
        raise ConfigError(problems)
    par, world = fill_dp(res.par, res.dp_given, world)
    if world != par.world_size:
        raise ConfigError([f"--nodes {args.nodes} × --gpus-per-node {args.gpus_per_node} = {world}"
                           f" ranks != pp·dp·ep·cp·tp = {par.world_size}"])
    problems = hybrid_problems(par, need_zero=False)  # the grid has no ZeRO stage to check
    if problems:
        raise ConfigError(problems)
    if args.print_config:
        from dataclasses import replace

        return flags.print_config(replace(res, par=par), f"fived grid: {world} rank(s)")
    grid = Grid.from_config(par)
    gpn = args.gpus_per_node or (grid.world_size // args.nodes if args.nodes else 0)
    names = ["tp", "cp", "ep", "dp", "pp"]
    derived = [g for g in DERIVED if grid.hybrid or g not in HYBRID_GROUPS]
    dims = [d for d in DIMS if par.degree(d) > 1 or args.wide] or ["dp"]
    groups = [g for g in names if par.degree(g) > 1 or args.wide]
    sub = grid.sub_degrees()
    if grid.hybrid:  # dp's two sub-dimensions after dp, and the groups ZeRO uses
        dims[dims.index("dp") + 1:dims.index("dp") + 1] = ["dp_shard", "dp_replicate"]
        hyb = ["dense_shard"] + (["expert_shard"] if par.ep > 1 else []) + ["dp_replicate"]
        groups += [g for g in hyb if g not in groups]
    if args.wide:
        groups += [g for g in derived if g not in groups]
    rows = []
    for r in range(grid.world_size):
        c = grid.coords(r)
        if grid.hybrid:
            c = {**c, "dp_shard": c["dp"] % sub["dp_shard"],
                 "dp_replicate": c["dp"] // sub["dp_shard"]}
        row = {"rank": r, **({"node": r // gpn} if gpn else {}), "coords": c,
               "groups": {g: grid.members(Grid.named_dims(g), r) for g in names + derived}}
        rows.append(row)
    warnings = []
    if gpn:
        for name in names + derived:
            if name == "dp_replicate":  # the replicas cross nodes by design
                continue
            if grid.world_size > 1 and grid.crosses_node(Grid.named_dims(name), gpn):
                warnings.append((name, name in ("tp", "cp")))
    if args.json:
        report.print_json({"layout": par.describe(), "world": grid.world_size,
                           **({"dp_shard": sub["dp_shard"], "dp_replicate": sub["dp_replicate"]}
                              if grid.hybrid else {}),
                           "order": list(grid.order), "gpus_per_node": gpn or None, "ranks": rows,
                           "crosses_node": [n for n, _ in warnings]})
        return 0
    con = report.console(args.wide)
    cols = [("rank", "r")] + ([("node", "r")] if gpn else []) + [(d, "r") for d in dims]
    cols += [(f"{g} group", "l") for g in groups]
    t = report.table(f"grid {par.describe()}: {grid.world_size} ranks, order "
                     f"{'·'.join(grid.order)} (outermost first)", cols,
                     wrap=tuple(f"{g} group" for g in groups))
    for row in rows:
        cells = [str(row["rank"])] + ([str(row["node"])] if gpn else [])
        cells += [str(row["coords"][d]) for d in dims]
        for g in groups:
            m = row["groups"][g]
            cells.append((",".join(map(str, m)) if args.wide else report.ranks(m))
                         if len(m) > 1 else "-")
        t.add_row(*cells)
    report.show(con, t)
    if not args.wide:
        con.print("[dim]--wide: every coordinate and the derived groups; --json: all of it[/]")
    if grid.hybrid:
        con.print(f"hybrid sharding: dp {par.dp} = dp-shard {sub['dp_shard']} × dp-replicate "
                  f"{sub['dp_replicate']}; ZeRO shards over dense_shard (dp_shard·ep·cp"
                  + (", experts over expert_shard: dp_shard·cp" if par.ep > 1 else "")
                  + "), the shard's gradient is all-reduced over dp_replicate")
    for name, hot in warnings:
        if name == "dense_shard":
            con.print(f"[bold red]WARNING[/]: a ZeRO shard group (dense_shard) crosses a node "
                      f"boundary ({gpn} GPUs per node) — its all-gathers and reduce-scatters "
                      f"run every layer; pick --dp-shard so dp_shard·ep·cp·tp ranks fit in a "
                      f"node")
            continue
        tag = "[bold red]WARNING[/]" if hot else "note"
        con.print(f"{tag}: {name} groups cross a node boundary ({gpn} GPUs per node)"
                  + (" — tp and cp talk every layer and belong inside a node" if hot else ""))
    return 0
