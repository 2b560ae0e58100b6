"""What a rank owns of the data-parallel engine's state, as boxes of global tensors: the
parameter elements (``owned``) and every optimizer state (``optim_entries``), so that any
layout reads what any other wrote.

Optimizer states, by kind (``G`` = a parameter's global name, (R, C) its global matrix: a 2-D
parameter as is, a 1-D one of n elements as (1, n)):

    optim.S.G   shape of G    element-wise: the optimizer's ``flat_state(i)`` (named by its
                              ``flat_names``: AdamW m, v; RowNorm m; Muon m) and its ``owned``
                              extras (Muon's AdamW v, only for the non-Muon parameters: embedding,
                              head, norms) — each rank writes the elements it owns
    optim.R.G   (R,)          a ``rows`` statistic: Adafactor's row sums R_i of the GLOBAL matrix
    optim.C.G   (C,)          a ``cols`` statistic: Adafactor's column sums C_j

Adafactor's statistics are complete after every step on every rank that holds any piece of the
matrix (``fived.optim.pieces.reduce_stats`` all-reduces them over ZeRO and tp), so a rank holds
the rows (columns) of its tp chunk: all of R and the chunk's slice of C when tp cuts columns,
the chunk's slice of R and all of C when it cuts rows. Every ZeRO member writes the same boxes
(DCP keeps one). Being statistics of the global matrix, they reshard to any dp/ZeRO/tp/pp/ep
layout; only their summation order (≈1e-7 relative) depends on the layout.

The optimizer is duck-typed (``flat_state``, ``flat_names``, ``extra_state`` with keys
``S.BUCKET.PARAM`` and ``state_kinds``, ``t``): checkpoint imports no optimizer code.
"""

from __future__ import annotations

from typing import Any

import torch

Entry = tuple[str, tuple[int, ...], torch.Tensor, tuple[int, ...], tuple[int, ...], int, int]


def owned(engine: Any, placements: dict[str, Any]):
    """(bucket index, local name, global name, global shape, piece shape, shift, [a, c)
    piece-relative, [a, c) shard-relative) for every parameter element range this rank owns."""
    for i, b in enumerate(engine.buckets):
        for j, lname in enumerate(b.names):
            pl = placements[lname]
            p = b.params[j]
            off, n = b.offsets[j], p.numel()
            a, c = max(off, b.lo), min(off + n, b.hi)
            if a >= c:
                continue
            shape = tuple(p.shape)
            yield i, lname, pl.name, tuple(pl.shape), shape, shift_of(pl, shape), (a - off, c - off), (
                a - b.lo, c - b.lo)


def shift_of(pl: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Where a rank's tp/ep piece of ``shape`` sits in the global tensor."""
    shift = [0] * len(shape)
    if pl.parts > 1:
        shift[pl.dim] = pl.index * shape[pl.dim]
    return tuple(shift)


def flat_states(opt: Any, n_buckets: int) -> dict[str, list[torch.Tensor]]:
    """Element-wise states laid out like each bucket's owned shard, by name."""
    names = getattr(opt, "flat_names", ())
    per: dict[str, list[Any]] = {}
    for i in range(n_buckets):
        flats = opt.flat_state(i)
        if len(flats) != len(names):
            raise ValueError(f"{type(opt).__name__}: flat_state has {len(flats)} tensors, "
                             f"flat_names {names}")
        for name, t in zip(names, flats):
            per.setdefault(name, [None] * n_buckets)[i] = t
    return per


def extra_states(opt: Any) -> dict[tuple[str, int, str], tuple[str, torch.Tensor]]:
    """(state, bucket, local parameter name) -> (kind, tensor) of ``extra_state()``."""
    kinds = getattr(opt, "state_kinds", {})
    out = {}
    extra = opt.extra_state() if hasattr(opt, "extra_state") else {}
    for key, t in extra.items():
        s, i, lname = key.split(".", 2)
        if s not in kinds:
            raise ValueError(f"{type(opt).__name__}: state {s!r} has no kind in state_kinds "
                             "(a checkpoint could not save it)")
        out[(s, int(i), lname)] = (kinds[s], t)
    return out


def scalars(opt: Any) -> dict[str, Any]:
    return {"t": int(opt.t)}


def matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    return (1, int(shape[0])) if len(shape) == 1 else (int(shape[0]), int(shape[1]))


def optim_entries(engine: Any, placements: dict[str, Any]) -> list[Entry]:
    """(key, global shape, local tensor whose element 0 is piece element a, piece shape, shift,
    a, b) for every optimizer state element range this rank holds."""
    opt = engine.opt
    flats = flat_states(opt, len(engine.buckets))
    extras = extra_states(opt)
    out: list[Entry] = []
    per_piece: dict[tuple[int, str], list[tuple[str, torch.Tensor]]] = {}
    for (s, i, lname), (kind, t) in extras.items():
        if kind == "owned":
            per_piece.setdefault((i, lname), []).append((s, t))
    for i, lname, g, gshape, shape, shift, (a, c), (s0, s1) in owned(engine, placements):
        for s, per in flats.items():
            out.append((f"optim.{s}.{g}", gshape, per[i][s0:s1], shape, shift, a, c))
        for s, t in per_piece.get((i, lname), []):
            if t.numel() != c - a:
                raise ValueError(f"{s} of {lname}: {t.numel()} values, {c - a} owned")
            out.append((f"optim.{s}.{g}", gshape, t, shape, shift, a, c))
    for (s, i, lname), (kind, t) in sorted(extras.items()):
        if kind == "owned":
            continue
        if kind not in ("rows", "cols"):
            raise ValueError(f"{type(opt).__name__}: unknown state kind {kind!r} of {s}")
        b = engine.buckets[i]
        pl = placements[lname]
        rows, cols = matrix(tuple(b.params[b.names.index(lname)].shape))
        grows, gcols = matrix(tuple(pl.shape))
        cut = -1 if pl.parts == 1 else (pl.dim if len(pl.shape) == 2 else 1)
        if kind == "rows":
            n, gn, at = rows, grows, pl.index * rows if cut == 0 else 0
        else:
            n, gn, at = cols, gcols, pl.index * cols if cut == 1 else 0
        if t.numel() != n:
            raise ValueError(f"{s} of {lname}: {t.numel()} values, expected {n} ({kind})")
        out.append((f"optim.{s}.{pl.name}", (gn,), t, (n,), (at,), 0, n))
    return out

