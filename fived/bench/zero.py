"""``fived bench zero``: fived ZeRO-1/2/3 against PyTorch FSDP2 (``fully_shard`` per block and
on the root, its default ``reshard_after_forward=True``: the ZeRO-3 schedule), plus PyTorch DDP
for scale, on the same model, ranks and data in one run (alternating, medians; see
``fived.bench.harness`` for the method: every torch peer runs fused AdamW and fived's
clipping). The "comm hidden" column for fived ZeRO-3 compares its
wait for collectives with prefetch and overlapped reduce-scatters against ``--no-overlap``
(gathers on demand, reductions after backward). FSDP1 (``FullyShardedDataParallel``, one unit
per block, ``use_orig_params``, fused AdamW, its own ``clip_grad_norm_``) runs beside them as
the older peer.

``--hsdp N`` (hybrid sharding, docs/data-parallel.md): fived's hybrid ZeRO-3 (``--dp-shard N``,
``--nprocs``/N replicas; with and without overlap) against torch FSDP2 ``fully_shard`` on a 2-D
device mesh (replicate, shard) = (nprocs/N, N) — HSDP as torch does it — and fived's flat ZeRO-3
for scale; the ratio is against FSDP2's HSDP.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from . import harness
from .harness import Runner, fived_runner, hidden_fraction, torch_ddp_runner, torch_runner


def fsdp2_runner(cfg: Any, train: Any, world: int, batch: Callable[[int], tuple]) -> Runner:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ..model import build_model

    mesh = init_device_mesh("cpu", (world,))
    model = build_model(cfg, train.seed)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return torch_runner("torch FSDP2", model, model, cfg, train, world, batch, set_to_none=True)


def fsdp2_hsdp_runner(cfg: Any, train: Any, world: int, shard: int,
                      batch: Callable[[int], tuple]) -> Runner:
    """torch FSDP2 HSDP: ``fully_shard`` per block and on the root over a 2-D mesh
    (replicate, shard): parameters sharded over ``shard`` ranks, gradients reduce-scattered
    there and all-reduced across the replicas."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ..model import build_model

    mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    model = build_model(cfg, train.seed)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return torch_runner("torch FSDP2 HSDP", model, model, cfg, train, world, batch,
                        set_to_none=True)


def hsdp_runners(cfg: Any, par: Any, train: Any, args: Any, rank: int, world: int,
                 batch: Callable) -> list[Runner]:
    n = args.hsdp
    return [fived_runner(f"fived HSDP ZeRO-3 {n}×{world // n}", cfg, par, train, rank, world,
                         batch),
            fived_runner("fived HSDP ZeRO-3 no-overlap", cfg, replace(par, overlap=False),
                         train, rank, world, batch),
            fived_runner("fived ZeRO-3 flat", cfg, replace(par, dp_shard=0), train, rank,
                         world, batch),
            fsdp2_hsdp_runner(cfg, train, world, n, batch)]


def fsdp1_runner(cfg: Any, train: Any, world: int, batch: Callable[[int], tuple]) -> Runner:
    """torch FSDP1: ``FullyShardedDataParallel`` wrapping each block (and the root), FULL_SHARD,
    the same fastest AdamW as the other peers (``harness.fastest_adamw``) and the same global-norm
    clipping (FSDP1's own ``clip_grad_norm_``, which knows its flat shards)."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from ..model import build_model

    model = build_model(cfg, train.seed)
    block = type(next(iter(model.layers.values())))
    wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({block}),
                   device_id=torch.device("cpu"), use_orig_params=True)
    return torch_runner("torch FSDP1", wrapped, wrapped, cfg, train, world, batch,
                        set_to_none=True, clip=wrapped.clip_grad_norm_)


def zero_runners(cfg: Any, par: Any, train: Any, args: Any, rank: int, world: int,
                 batch: Callable) -> list[Runner]:
    if getattr(args, "hsdp", 0):
        return hsdp_runners(cfg, par, train, args, rank, world, batch)
    runners = [fived_runner(f"fived ZeRO-{z}", cfg, replace(par, zero=z), train, rank, world,
                            batch) for z in (1, 2, 3)]
    runners.append(fived_runner("fived ZeRO-3 no-overlap", cfg,
                                replace(par, zero=3, overlap=False), train, rank, world, batch))
    runners.append(fsdp2_runner(cfg, train, world, batch))
    runners.append(fsdp1_runner(cfg, train, world, batch))
    runners.append(torch_ddp_runner(cfg, train, args.bucket_mb, world, batch))
    return runners


def hidden_for(rows: list[dict]) -> dict[str, float | None]:
    hsdp = next((r["name"] for r in rows if r["name"].startswith("fived HSDP ZeRO-3 ")
                 and "no-overlap" not in r["name"]), None)
    if hsdp:
        return {hsdp: hidden_fraction(rows, hsdp, "fived HSDP ZeRO-3 no-overlap")}
    return {"fived ZeRO-3": hidden_fraction(rows, "fived ZeRO-3", "fived ZeRO-3 no-overlap")}


def hsdp_arg(ap: Any) -> None:
    ap.add_argument("--hsdp", type=int, default=0, metavar="N",
                    help="hybrid sharding: fived ZeRO-3 with --dp-shard N against torch FSDP2 "
                         "on a 2-D (replicate, shard) mesh; N must divide --nprocs, 1 < N < "
                         "--nprocs (default 0: the flat ZeRO comparison)")


def check_hsdp(ap: Any, args: Any) -> None:
    n, w = args.hsdp, args.nprocs
    if n and (n < 0 or w % n or not 1 < n < w):
        ok = ", ".join(str(k) for k in range(2, w) if w % k == 0) or "none (use more ranks)"
        ap.error(f"--hsdp {n}: the shard degree must divide --nprocs {w} and leave at least 2 "
                 f"replicas; valid values: {ok}")


def main(argv: list[str] | None = None) -> int:
    return harness.main(sys.argv[1:] if argv is None else argv, "zero", zero_runners, hidden_for,
                        lambda a: "torch FSDP2 HSDP" if a.hsdp else "torch FSDP2",
                        "fived ZeRO-1/2/3 vs FSDP2 fully_shard",
                        "fived ZeRO-1/2/3 against FSDP2 (--hsdp N: hybrid sharding against "
                        "FSDP2's HSDP)", more_args=hsdp_arg, check=check_hsdp)
