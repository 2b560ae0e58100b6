"""Predicted against measured: the ledger's bytes for each rank next to what ``fived train
--metrics-out`` recorded, compared exactly.

Every step record the trainer writes holds ``memory_per_rank`` (the engine's model-state bytes)
and ``traffic_per_rank`` (bytes sent per group name). ``compare_record`` predicts both for every
rank from its grid coordinates (mixed radix over ``par.order``, as ``fived.grid`` numbers ranks)
and returns one line per mismatch; an empty list means the ledger and the runtime agree to the
byte.
"""

from __future__ import annotations

import json

from ..config import ModelConfig, ParallelConfig
from .memory import model_states
from .traffic import micro_batch_size, step_bytes

_GROUPS = {"dense": ("dp", "ep", "cp"), "expert": ("dp", "cp")}


def coords(par: ParallelConfig, rank: int) -> dict[str, int]:
    """The rank's coordinate in each dimension (the grid's mixed radix, innermost last)."""
    out, r = {}, rank
    for d in reversed(par.order):
        out[d] = r % par.degree(d)
        r //= par.degree(d)
    return out


def group_index(par: ParallelConfig, group: str, rank: int) -> int:
    """Index of ``rank`` among the members of its ``group`` (members sorted by rank)."""
    c = coords(par, rank)
    dims = [d for d in par.order if d in _GROUPS.get(group, (group,))]
    idx = 0
    for d in dims:
        idx = idx * par.degree(d) + c[d]
    return idx


def predict_rank(m: ModelConfig, par: ParallelConfig, global_batch: int, rank: int
                 ) -> tuple[dict[str, int], dict[str, float]]:
    """(engine.memory() bytes, traffic bytes by group) the ledger predicts for one rank."""
    c = coords(par, rank)
    mem = model_states(m, par, c["pp"], group_index(par, "dense", rank),
                       group_index(par, "expert", rank))
    return mem, step_bytes(m, par, micro_batch_size(par, global_batch), c["pp"])


def compare_record(m: ModelConfig, par: ParallelConfig, global_batch: int, rec: dict,
                   skip_buffers: bool | None = None) -> list[str]:
    """Mismatches between one step record and the ledger, one line each ([] = exact).

    ``buffers`` is the engine's measured peak of transient buffers (ZeRO-2 full gradient
    buckets, ZeRO-3 gathered units), which depends on the order hooks fire; it is skipped by
    default for ZeRO-2/3 (``skip_buffers``) and compared (it is 0) otherwise."""
    if skip_buffers is None:
        skip_buffers = par.zero >= 2
    out = []
    # the trainer records memory as integers (``int`` of each key: a ZeRO shard's padding
    # share pad/N is fractional), so the prediction is truncated the same way
    mems = rec.get("memory_per_rank") or [rec["memory"]]
    trs = rec.get("traffic_per_rank") or [{"bytes": rec["traffic"]}]
    for rank, (mem, tr) in enumerate(zip(mems, trs)):
        pm, pt = predict_rank(m, par, global_batch, rank)
        pm = {k: int(v) for k, v in pm.items()}
        if skip_buffers:
            pm.pop("buffers", None)
            mem = {k: v for k, v in mem.items() if k != "buffers"}
        for k in sorted(set(pm) | set(mem)):
            if pm.get(k, 0) != mem.get(k, 0):
                out.append(f"rank {rank} memory[{k}]: ledger {pm.get(k, 0)} != "
                           f"measured {mem.get(k, 0)}")
        got = tr["bytes"] if "bytes" in tr else tr
        for k in sorted(set(pt) | set(got)):
            if pt.get(k, 0.0) != got.get(k, 0.0):
                out.append(f"rank {rank} traffic[{k}]: ledger {pt.get(k, 0.0)} != "
                           f"measured {got.get(k, 0.0)}")
    return out


def compare_file(m: ModelConfig, par: ParallelConfig, global_batch: int, path: str,
                 step: int = -1, skip_buffers: bool | None = None) -> list[str]:
    """``compare_record`` on one step (default: the last) of a ``--metrics-out`` JSONL file."""
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    if not recs:
        return [f"{path}: no step records"]
    return compare_record(m, par, global_batch, recs[step], skip_buffers)
