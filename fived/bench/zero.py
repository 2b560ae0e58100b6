"""``fived bench zero``: fived ZeRO-1/2/3 against PyTorch FSDP2 (``fully_shard`` per block and
on the root, its default ``reshard_after_forward=True``: the ZeRO-3 schedule), plus PyTorch DDP
for scale, on the same model, ranks and data in one run (alternating, medians; see
``fived.bench.harness`` for the method: every torch peer runs fused AdamW and fived's
clipping). The "comm hidden" column for fived ZeRO-3 compares its
wait for collectives with prefetch and overlapped reduce-scatters against ``--no-overlap``
(gathers on demand, reductions after backward). FSDP1 (``FullyShardedDataParallel``, one unit
per block, ``use_orig_params``, fused AdamW, its own ``clip_grad_norm_``) runs beside them as
the older peer.
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
    runners = [fived_runner(f"fived ZeRO-{z}", cfg, replace(par, zero=z), train, rank, world,
                            batch) for z in (1, 2, 3)]
    runners.append(fived_runner("fived ZeRO-3 no-overlap", cfg,
                                replace(par, zero=3, overlap=False), train, rank, world, batch))
    runners.append(fsdp2_runner(cfg, train, world, batch))
    runners.append(fsdp1_runner(cfg, train, world, batch))
    runners.append(torch_ddp_runner(cfg, train, args.bucket_mb, world, batch))
    return runners


def hidden_for(rows: list[dict]) -> dict[str, float | None]:
    return {"fived ZeRO-3": hidden_fraction(rows, "fived ZeRO-3", "fived ZeRO-3 no-overlap")}


def main(argv: list[str] | None = None) -> int:
    return harness.main(sys.argv[1:] if argv is None else argv, "zero", zero_runners, hidden_for,
                        "torch FSDP2", "fived ZeRO-1/2/3 vs FSDP2 fully_shard",
                        "fived ZeRO-1/2/3 against FSDP2")
