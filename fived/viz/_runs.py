"""Runs the figures measure: short ``fived train`` runs on spawned gloo ranks, their records kept.

``train_many(runs)`` groups (model, layout, train) triples by world size, trains each group in
one spawn (``fived.train.trainer.train_rank``, no display) and returns, per run in the given
order, the last step's record: ``memory_per_rank`` (the engines' ``memory()`` bytes),
``traffic_per_rank`` (bytes and seconds by group name), ``seconds`` (the step's wall time) and
the losses. These are the numbers ``fived ledger --check`` compares with the ledger.

Every rank runs one intra-op thread, whatever the world size, so that step times of different
world sizes compare the same per-rank resources (and a one-rank run does not spin two OpenMP
threads against a loaded machine: that made a tiny step take seconds).
"""

from __future__ import annotations

from typing import Any


def rank_fn(rank: int, world: int, runs: list[tuple]) -> list[dict[str, Any]]:
    import torch

    from ..train.trainer import train_rank

    torch.set_num_threads(1)

    out = []
    for m, p, t in runs:
        s = train_rank(rank, world, m, p, t, show=False)
        last = s["history"][-1]
        out.append({"memory_per_rank": last["memory_per_rank"],
                    "traffic_per_rank": last["traffic_per_rank"],
                    "seconds": [h["seconds"] for h in s["history"]],
                    "losses": s["losses"]})
    return out


def train_many(runs: list[tuple], timeout: float = 900.0) -> list[dict[str, Any]]:
    from ..testing import run_ranks

    by_world: dict[int, list[int]] = {}
    for i, (_, p, _) in enumerate(runs):
        by_world.setdefault(p.world_size, []).append(i)
    out: list[dict[str, Any] | None] = [None] * len(runs)
    for world, idx in by_world.items():
        res = run_ranks(rank_fn, world, [runs[i] for i in idx], timeout=timeout)[0]
        for i, r in zip(idx, res):
            out[i] = r
    return out  # type: ignore[return-value]
