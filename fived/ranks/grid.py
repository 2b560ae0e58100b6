"""The rank grid: rank <-> (pp, dp, ep, cp, tp) coordinates and one group per dimension.

A rank's coordinates are the digits of its number in a mixed radix whose digits are the
degrees, listed outermost first (default ``pp, dp, ep, cp, tp``: tp innermost, so a tp group is
contiguous ranks on one node, and pp outermost)::

    rank = sum_d coord[d] * stride[d],   stride[innermost] = 1,   stride[d] = prod(degrees inside d)

A *group over a set of dimensions* is the set of ranks that share every other coordinate.
Besides one group per dimension, fived uses derived groups:

* ``dense``  = dp·ep·cp — the ranks that hold the same dense parameter shard and see different
  tokens, so dense gradients are reduced (or ZeRO-sharded) over it;
* ``expert`` = dp·cp    — the ranks that hold the same experts; expert gradients reduce there;
* ``batch``  = dp·ep    — the ranks that read different sequences of the global batch.

Hybrid sharding (``--dp-shard N --dp-replicate M``, dp = N·M) splits dp's coordinate into two
sub-dimensions, dp = dp_replicate·N + dp_shard (shard inside replicate, so a shard group is
contiguous ranks), and adds:

* ``dense_shard``  = dp_shard·ep·cp — ZeRO's group for dense parameters;
* ``expert_shard`` = dp_shard·cp    — ZeRO's group for expert parameters;
* ``dp_replicate`` = dp_replicate   — the replicas, over which each reduced shard is summed.

Without it (M = 1) they are ``dense``, ``expert`` and one rank, and ``connect`` makes no new
process group for them (``--dp`` alone: today's groups exactly).

One group is not a product of dimensions: ``embed``, Megatron's embedding group — inside a pp
group, the rank holding the first pipeline stage and the one holding the last (pp 0 and
pp − 1; a V-shaped schedule puts both on pp 0, a group of one), which both hold the embedding
when the head is tied to it or multi-token prediction reads it; every other rank is a group of
one. Its gradient is summed there once per step.

``DERIVED`` is the one list of derived groups and ``GROUP_NAMES`` (dimensions, then derived) the
one list of every group name: code that needs the names (traffic keys, tables) imports them.

The grid is pure arithmetic (``coords``, ``members``, ``members_of``, ``index_in``,
``partition``, ``crosses_node``); ``Grid.connect()`` creates the process groups (all ranks call
it, in the same order) and binds each to the rank's ``Traffic`` so every byte can be counted.
``grid[name]`` — the ``DimGroup`` collectives run on — exists only on a connected grid: on an
unconnected one it raises, because a group without a process group would send to the world.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from ..config import DIMS, V_SCHEDULES, ParallelConfig

DERIVED: dict[str, tuple[str, ...]] = {
    "dense": ("dp", "ep", "cp"),
    "expert": ("dp", "cp"),
    "batch": ("dp", "ep"),
    # hybrid sharding (``--dp-shard N --dp-replicate M``): dp's coordinate is split as
    # dp = dp_replicate·N + dp_shard (shard inside replicate), and ZeRO shards over the shard
    # part of its group while the replicate part all-reduces the shard's piece
    "dense_shard": ("dp_shard", "ep", "cp"),
    "expert_shard": ("dp_shard", "cp"),
    "dp_replicate": ("dp_replicate",),
}
EMBED = "embed"  # the embedding group: the ends of each pipeline (not a product of dimensions)
GROUP_NAMES: tuple[str, ...] = (*DIMS, *DERIVED, EMBED)
HYBRID_GROUPS: tuple[str, ...] = ("dense_shard", "expert_shard", "dp_replicate")
SUB_DIMS = ("dp_shard", "dp_replicate")  # dp's two sub-dimensions (hybrid sharding)


class NotConnected(RuntimeError):
    """``grid[name]`` on a grid whose ``connect()`` was not called."""


@dataclass
class DimGroup:
    """A group this rank belongs to: its member ranks, its index in them, and the process group."""

    name: str
    ranks: tuple[int, ...]
    rank: int  # this rank's index within ``ranks``
    pg: Any = None  # torch.distributed ProcessGroup; None when the group has one member
    traffic: Any = None  # fived.comm.Traffic of this rank

    @property
    def size(self) -> int:
        return len(self.ranks)

    def global_rank(self, index: int) -> int:
        return self.ranks[index % self.size]


@dataclass
class Grid:
    degrees: dict[str, int]
    order: tuple[str, ...] = DIMS
    rank: int = 0
    groups: dict[str, DimGroup] = field(default_factory=dict)
    dp_shard: int = 0  # N, the shard part of dp (0: all of dp, flat ZeRO)
    v_shaped: bool = False  # a V-shaped pipeline schedule: the first and last stage on pp 0

    @classmethod
    def from_config(cls, par: ParallelConfig, rank: int = 0) -> Grid:
        shard = par.shard_degree if par.hybrid else 0
        return cls({d: par.degree(d) for d in DIMS}, tuple(par.order), rank, dp_shard=shard,
                   v_shaped=par.schedule in V_SCHEDULES)

    def embed_ends(self) -> tuple[int, ...]:
        """The pp coordinates of the pipeline's first and last stage (one with a V)."""
        return (0,) if self.v_shaped else tuple(sorted({0, self.degrees["pp"] - 1}))

    # ------------------------------------------------------------ hybrid sharding
    def sub_degrees(self) -> dict[str, int]:
        """dp's sub-dimensions: {dp_shard: N, dp_replicate: M}, N·M = dp (M = 1: flat)."""
        n = self.dp_shard or self.degrees["dp"]
        return {"dp_shard": n, "dp_replicate": self.degrees["dp"] // n}

    @property
    def hybrid(self) -> bool:
        """ZeRO over the shard part of each group, replicas across (``--dp-replicate`` > 1)."""
        return self.sub_degrees()["dp_replicate"] > 1

    def shard_group(self, name: str) -> str:
        """The group ZeRO shards a ``name`` (dense | expert) bucket over: ``name_shard`` when
        hybrid, else ``name`` itself (today's flat layout)."""
        return f"{name}_shard" if self.hybrid and f"{name}_shard" in DERIVED else name

    def group_names_used(self) -> list[str]:
        """The group names of this layout: the hybrid ones only when hybrid."""
        return [n for n in GROUP_NAMES if self.hybrid or n not in HYBRID_GROUPS]

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees.values())

    def strides(self) -> dict[str, int]:
        s, out = 1, {}
        for d in reversed(self.order):
            out[d] = s
            s *= self.degrees[d]
        return out

    def coords(self, rank: int | None = None) -> dict[str, int]:
        r = self.rank if rank is None else rank
        st = self.strides()
        return {d: (r // st[d]) % self.degrees[d] for d in DIMS}

    def rank_of(self, **coords: int) -> int:
        st = self.strides()
        base = self.coords()
        base.update(coords)
        return sum(base[d] * st[d] for d in DIMS)

    def members(self, dims: tuple[str, ...], rank: int | None = None) -> tuple[int, ...]:
        """Ranks sharing every coordinate of ``rank`` outside ``dims``, in rank order (``dims``
        may name dp's sub-dimensions dp_shard, dp_replicate: dp = dp_replicate·N + dp_shard)."""
        c = self.coords(rank)
        st = self.strides()
        if dims == (EMBED,):  # the embedding group: the pipeline's two ends, or one rank
            if c["pp"] not in self.embed_ends():
                return (sum(c[d] * st[d] for d in DIMS),)
            return tuple(sorted(sum((e if d == "pp" else c[d]) * st[d] for d in DIMS)
                                for e in self.embed_ends()))
        sub = self.sub_degrees()
        n = sub["dp_shard"]
        c["dp_shard"], c["dp_replicate"] = c["dp"] % n, c["dp"] // n
        deg = {**self.degrees, **sub}
        split = any(d in SUB_DIMS for d in dims)
        out = []
        for combo in itertools.product(*(range(deg[d]) for d in dims)):
            cc = dict(c)
            cc.update(zip(dims, combo))
            if split:
                cc["dp"] = cc["dp_replicate"] * n + cc["dp_shard"]
            out.append(sum(cc[d] * st[d] for d in DIMS))
        return tuple(sorted(out))

    def partition(self, dims: tuple[str, ...]) -> list[tuple[int, ...]]:
        """All groups over ``dims``: a partition of the world."""
        seen, out = set(), []
        for r in range(self.world_size):
            m = self.members(dims, r)
            if m not in seen:
                seen.add(m)
                out.append(m)
        return out

    @staticmethod
    def named_dims(name: str) -> tuple[str, ...]:
        if name not in GROUP_NAMES:
            raise KeyError(f"no group named {name!r}; the groups are {', '.join(GROUP_NAMES)}")
        return DERIVED.get(name, (name,))

    def group_names(self) -> list[str]:
        return list(GROUP_NAMES)

    def shard_partition_crosses_node(self, gpus_per_node: int) -> bool:
        """True when a hybrid shard group (dense_shard) spans more than one node."""
        return self.crosses_node(DERIVED["dense_shard"], gpus_per_node)

    def members_of(self, name: str, rank: int | None = None) -> tuple[int, ...]:
        """The ranks of the group ``name`` (a dimension or a derived group) that ``rank`` is in."""
        return self.members(self.named_dims(name), rank)

    def index_in(self, name: str, rank: int | None = None) -> int:
        """``rank``'s index in its group ``name`` (what ``grid[name].rank`` is once connected)."""
        r = self.rank if rank is None else rank
        return self.members_of(name, r).index(r)

    @property
    def connected(self) -> bool:
        return bool(self.groups)

    # ------------------------------------------------------------ process groups
    def connect(self, traffic: Any, backend: str | None = None) -> Grid:
        """Create every group (collectively) and keep the ones this rank is in."""
        import torch.distributed as dist

        for name in GROUP_NAMES:
            dims = self.named_dims(name)
            parts = self.partition(dims)
            mine = self.members(dims)
            if name == EMBED:  # groups of two and of one side by side: every rank calls
                multi = [list(p) for p in parts if len(p) > 1]
                pg = None
                if len(mine) == self.world_size:
                    pg = dist.group.WORLD
                elif multi:
                    got, _ = dist.new_subgroups_by_enumeration(multi, backend=backend)
                    pg = got if len(mine) > 1 else None
            elif len(mine) == 1:
                pg = None
            elif len(mine) == self.world_size:
                pg = dist.group.WORLD
            elif name in HYBRID_GROUPS and not self.hybrid:
                # flat: dense_shard is dense, expert_shard is expert (the same ranks); no new
                # process group, so ``--dp`` alone creates exactly today's groups
                pg = self.groups[name.removesuffix("_shard")].pg
            else:
                pg, _ = dist.new_subgroups_by_enumeration(
                    [list(p) for p in parts], backend=backend
                )
            self.groups[name] = DimGroup(name, mine, mine.index(self.rank), pg, traffic)
        return self

    def __getitem__(self, name: str) -> DimGroup:
        """The connected group ``name`` of this rank; raises ``NotConnected`` before
        ``connect()`` (use ``members_of``/``index_in``/``coords`` for arithmetic)."""
        if not self.connected:
            raise NotConnected(
                f"grid[{name!r}]: this Grid is not connected, so it has no process groups and a "
                f"collective on it would go to the whole world. Call grid.connect(traffic) on "
                f"every rank first (a one-rank grid needs no process group), or for arithmetic "
                f"use grid.members_of({name!r}), grid.index_in({name!r}) or grid.coords()")
        if name not in self.groups:
            raise KeyError(f"no group named {name!r}; the groups are {', '.join(GROUP_NAMES)}")
        return self.groups[name]

    # ------------------------------------------------------------ pipeline neighbours
    @property
    def pp_prev(self) -> int | None:
        c = self.coords()["pp"]
        return self.rank_of(pp=c - 1) if c > 0 else None

    @property
    def pp_next(self) -> int | None:
        c = self.coords()["pp"]
        return self.rank_of(pp=c + 1) if c < self.degrees["pp"] - 1 else None

    # ------------------------------------------------------------ topology
    def crosses_node(self, dims: tuple[str, ...], gpus_per_node: int) -> bool:
        """True when some group over ``dims`` spans more than one node."""
        return any(
            len({r // gpus_per_node for r in part}) > 1 for part in self.partition(dims)
        )
