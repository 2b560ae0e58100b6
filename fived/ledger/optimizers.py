"""The optimizer's share of the ledger: state bytes and the extra traffic of each ``--optimizer``
(``fived.optim``), per rank, exactly as the runtime allocates and sends them. Torch-free.

State bytes (Ψ_b = the elements of bucket b this rank steps: all of them with ZeRO-0, its shard
S_b with ZeRO-1/2/3; R, C = a tp-local matrix's rows and columns, a 1-D parameter is (1, n)):

    adamw      8 Ψ_b                     (m, v)
    rownorm    4 Ψ_b                     (m)
    adafactor  Σ_matrices 4 (R + C)      (factored second moment, on every ZeRO member)
    muon       4 Ψ_b + 4 · (owned elements of the AdamW parameters: embedding, head, norms)

Extra traffic per step, bytes sent per rank (N = the bucket group, 4-byte statistics):

    adamw      0
    rownorm    ZeRO (shards not aligned to rows): all-reduce 2(N−1)/N · 4 Σ R   over the group
               tp: all-reduce 2(tp−1)/tp · 4 Σ R over the row-cut (dim 1) matrices
    adafactor  ZeRO: all-reduce of 4 Σ (R + C); tp: 4 (Σ R of dim-1 cuts + Σ C of dim-0 cuts)
    muon       ZeRO: all-gather (N−1)/N · 4 · padded bucket, per bucket holding a hidden matrix;
               tp: all-gather (tp−1) · 4 · R·C per tp-cut hidden matrix

``--zero-align rows`` pads each sharded bucket so every shard boundary falls on a whole row
(``aligned_shard_len``); rownorm then needs no ZeRO reduction.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..config import ModelConfig, ParallelConfig
from .params import fp8_gather, fp8_weight, param_list, zero3_unit


def aligned_shard_len(sizes: list[int], rows: list[int], n: int) -> int:
    """The smallest shard length S >= ⌈Σsizes/n⌉ whose boundaries i·S (0 < i < n) all fall on a
    whole row of the parameter they land in (``sizes[j]`` elements in rows of ``rows[j]``), or
    past the end (``--zero-align rows``)."""
    total = sum(sizes)
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    S = max(1, -(-total // n))
    while True:
        bad = None
        for i in range(1, n):
            x = i * S
            if x >= total:
                break
            j = bisect_right(offs, x) - 1
            r = (x - offs[j]) % rows[j]
            if r:
                bad = (i, x - r + rows[j])
                break
        if bad is None:
            return S
        i, nxt = bad
        S = max(S + 1, -(-nxt // i))


@dataclass(frozen=True)
class Param:
    name: str
    rows: int
    cols: int
    dim: int      # tp cut (0 rows, 1 columns)
    parts: int
    ndim: int
    expert: bool

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def muon(self) -> bool:
        return self.ndim == 2 and not self.name.startswith(("embed_tokens", "lm_head"))


def param_shape(m: ModelConfig, par: ParallelConfig, name: str, numel: int, expert: bool
                ) -> Param:
    """The tp-local matrix of parameter ``name`` and its tp cut."""
    tp, h = par.tp, m.hidden
    last = name.rsplit(".", 2)[-2]
    if name.endswith("norm.weight"):
        return Param(name, 1, numel, 0, 1, 1, expert)
    kvs = min(tp, m.kv_heads)
    if name.endswith(".bias"):  # one row, cut along its columns as its layer's output is
        parts = kvs if last in ("k_proj", "v_proj") else tp if last in (
            "q_proj", "gate_proj", "up_proj") else 1
        return Param(name, 1, numel, 1, parts, 1, expert)
    if name.startswith(("embed_tokens", "lm_head")) or last in ("q_proj", "gate_proj",
                                                                "up_proj"):
        p = Param(name, numel // h, h, 0, tp, 2, expert)
    elif last in ("k_proj", "v_proj"):
        p = Param(name, numel // h, h, 0, kvs, 2, expert)
    elif last in ("o_proj", "down_proj"):
        p = Param(name, h, numel // h, 1, tp, 2, expert)
    elif last in ("w1", "w3", "gate"):
        p = Param(name, numel // h, h, 0, 1, 2, expert)
    elif last == "w2":
        p = Param(name, h, numel // h, 1, 1, 2, expert)
    else:
        raise ValueError(f"no shape rule for {name}")
    assert p.numel == numel, (name, p, numel)
    return p


@dataclass(frozen=True)
class OptBucket:
    group: str
    shards: int
    params: tuple[Param, ...]
    padded: int

    @property
    def shard(self) -> int:
        return self.padded // self.shards


def _padded(ps: list[Param], shards: int, align: bool) -> int:
    numel = sum(p.numel for p in ps)
    if align and shards > 1:
        return aligned_shard_len([p.numel for p in ps], [p.cols for p in ps], shards) * shards
    return -(-numel // shards) * shards


@lru_cache(maxsize=4096)
def opt_buckets(m: ModelConfig, par: ParallelConfig, pp_rank: int, bks: tuple[Any, ...]
                ) -> tuple[OptBucket, ...]:
    """The engine's buckets ``bks`` (``memory._buckets``: group, numel, shards, unit, in
    launch order) with their parameters, and their padded length (row-aligned under
    ``--zero-align rows``)."""
    align = par.zero_align == "rows" and par.zero > 0
    queues: dict[tuple[int, str], list[Param]] = {}
    unit = zero3_unit(m, par, pp_rank) if par.zero == 3 else (lambda name: 0)
    gather8 = fp8_gather(par)  # ZeRO-3's fp8 gather: a unit's fp8 weights are a bucket apart
    for n, k, ex in reversed(param_list(m, par, pp_rank)):
        p = param_shape(m, par, n, k, ex)
        queues.setdefault((unit(n), "expert" if ex else "dense", gather8 and fp8_weight(n)),
                          []).append(p)
    out = []
    for b in bks:
        q = queues[(b.unit if par.zero == 3 else 0, b.group, bool(getattr(b, "fp8", 0)))]
        took, size = [], 0
        while size < b.numel:
            took.append(q.pop(0))
            size += took[-1].numel
        assert size == b.numel, (b, size)
        out.append(OptBucket(b.group, b.shards, tuple(took), _padded(took, b.shards, align)))
    return tuple(out)


def owned(b: OptBucket, index: int) -> list[tuple[Param, int]]:
    """(parameter, elements of it in shard ``index``) for every parameter of bucket b."""
    lo, hi = (index * b.shard, (index + 1) * b.shard) if b.shards > 1 else (0, b.padded)
    out, off = [], 0
    for p in b.params:
        out.append((p, max(0, min(off + p.numel, hi) - max(off, lo))))
        off += p.numel
    return out


def state_bytes(obs: tuple[OptBucket, ...], par: ParallelConfig, optimizer: str,
                dense_index: int = 0, expert_index: int = 0) -> int:
    """The optimizer's state bytes on one rank (its place in the dense / expert group)."""
    flat = {"adamw": 8, "rownorm": 4, "muon": 4, "adafactor": 0}[optimizer]
    total = 0
    for b in obs:
        held = b.padded if (par.zero == 0 or b.shards == 1) else b.shard
        total += flat * held
        if optimizer == "adafactor":
            total += sum(4 * (p.rows + p.cols) for p in b.params)
        elif optimizer == "muon":
            idx = expert_index if b.group == "expert" else dense_index
            total += sum(4 * k for p, k in owned(b, idx) if not p.muon)
    return total


def traffic(obs: tuple[OptBucket, ...], par: ParallelConfig, optimizer: str
            ) -> list[tuple[str, str, int, int]]:
    """(group, op, buffer bytes S, ranks n) of every extra collective one step runs, from the
    rank's buckets (``opt_buckets``)."""
    if optimizer == "adamw":
        return []
    bks = obs
    out: list[tuple[str, str, int, int]] = []
    if optimizer == "muon":
        for b in bks:
            mats = [p for p in b.params if p.muon]
            if mats and b.shards > 1:
                out.append((b.group, "all_gather", 4 * b.padded, b.shards))
            out += [("tp", "all_gather", 4 * p.numel * par.tp, par.tp)
                    for p in mats if p.parts > 1]
        return out
    aligned = par.zero_align == "rows" and par.zero > 0
    for g in sorted({b.group for b in bks}):
        mine = [b for b in bks if b.group == g]
        slots = tp_slots = 0
        for b in mine:
            for p in b.params:
                slots += p.rows + (p.cols if optimizer == "adafactor" else 0)
                if p.parts > 1 and p.dim == 1:
                    tp_slots += p.rows
                if optimizer == "adafactor" and p.parts > 1 and p.dim == 0:
                    tp_slots += p.cols
        zero_needed = not (optimizer == "rownorm" and aligned)
        if zero_needed and mine[0].shards > 1 and slots:
            out.append((g, "all_reduce", 4 * slots, mine[0].shards))
        if par.tp > 1 and tp_slots:
            out.append(("tp", "all_reduce", 4 * tp_slots, par.tp))
    return out
