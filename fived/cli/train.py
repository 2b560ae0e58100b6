"""``fived train``: train on local ranks it spawns itself, or under ``torchrun``.

With nothing given it trains the ``tiny`` model on the built-in corpus on 4 local ranks
(dp = 4). The configuration is resolved and validated (``fived.config.validate``, and
``check_outputs`` for --metrics-out) before torch is imported or any rank starts.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from ..config import ConfigError, check_count, check_outputs, check_runtime_model, fill_dp, validate
from ..dist.launch import torchrun_env
from . import flags
from .main import EXAMPLES


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="fived train", description="Train a model with any layout of the five dimensions, "
        "on local ranks (gloo on CPU) or under torchrun.", epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.add_config_flags(ap)
    g = ap.add_argument_group("launch", "where the ranks run")
    g.add_argument("--nprocs", type=int, default=None, metavar="N",
                   help="local ranks to spawn; without --dp, dp takes what the other degrees leave "
                        "(default: 4 ranks, or the product of the degrees; ignored under torchrun)")
    g.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                   help="collective timeout in seconds: a dead rank stops the others (default: 120)")
    return ap


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    res = flags.configs(args)
    model, train = res.model, res.train
    env = torchrun_env()  # (rank, world, local_rank) under torchrun, else None
    if env:
        world = env[1]
    else:
        if args.nprocs is not None:
            check_count("--nprocs", args.nprocs)
        world = args.nprocs
    if args.timeout <= 0:
        raise ConfigError([f"--timeout must be > 0 seconds (got {args.timeout:g})"])
    par, world = fill_dp(res.par, res.dp_given, world)
    validate(model, par, train, world)
    check_runtime_model(model)
    if args.print_config:
        return flags.print_config(replace(res, par=par), f"fived train: {world} rank(s)")
    check_outputs(train)
    if not env or env[0] == 0:  # under torchrun, rank 0 speaks
        print(f"fived train: {model.name} · {par.describe()} · {world} rank(s) · "
              f"{train.steps} steps · global batch {train.global_batch}×{model.seq_len} tokens",
              flush=True)
    from ..dist.launch import RankFailure, run_local
    from ..train.trainer import measure_matmul_peak, train_rank

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

