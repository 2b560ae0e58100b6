"""The grid: coordinates, groups, derived groups, node boundaries; groups only once connected."""

import pytest

from fived.config import ParallelConfig
from fived.ranks.grid import Grid, NotConnected
from fived.testing import run_ranks


def test_tp_innermost_pp_outermost():
    g = Grid.from_config(ParallelConfig(tp=2, dp=2, pp=2))
    assert g.coords(0) == {"pp": 0, "dp": 0, "ep": 0, "cp": 0, "tp": 0}
    assert g.coords(1)["tp"] == 1
    assert g.coords(2)["dp"] == 1
    assert g.coords(4)["pp"] == 1
    assert g.members(("tp",), 5) == (4, 5)
    assert g.members(("dp",), 5) == (5, 7)
    assert g.members(("pp",), 5) == (1, 5)


def test_round_trip_and_partitions():
    par = ParallelConfig(tp=2, cp=2, ep=2, dp=1, pp=2)
    g = Grid.from_config(par)
    seen = set()
    for r in range(g.world_size):
        c = g.coords(r)
        assert Grid(g.degrees, g.order, r).rank_of(**c) == r
        seen.add(tuple(c.values()))
    assert len(seen) == g.world_size
    for name in g.group_names():
        parts = g.partition(Grid.named_dims(name))
        flat = sorted(r for p in parts for r in p)
        assert flat == list(range(g.world_size)), name


def test_derived_groups():
    g = Grid.from_config(ParallelConfig(tp=2, cp=2, ep=2, dp=2))
    dense = g.members(Grid.named_dims("dense"), 0)
    expert = g.members(Grid.named_dims("expert"), 0)
    assert len(dense) == 8 and len(expert) == 4
    assert set(expert) < set(dense)
    assert all(g.coords(r)["tp"] == 0 for r in dense)


def test_custom_order():
    g = Grid.from_config(ParallelConfig(tp=2, dp=2, order=("pp", "ep", "cp", "tp", "dp")))
    assert g.members(("dp",), 0) == (0, 1)  # dp innermost now


def test_node_crossing():
    g = Grid.from_config(ParallelConfig(tp=4, dp=2))
    assert not g.crosses_node(("tp",), 4)
    assert g.crosses_node(("dp",), 4)
    assert g.crosses_node(("tp",), 2)


def test_pipeline_neighbours():
    g = Grid.from_config(ParallelConfig(tp=2, pp=3), rank=3)
    assert g.coords()["pp"] == 1
    assert g.pp_prev == 1 and g.pp_next == 5


# ------------------------------------------------------------------ names and connection
def test_group_names_are_listed_once():
    from fived.config import DIMS
    from fived.ranks.grid import DERIVED, EMBED, GROUP_NAMES

    assert GROUP_NAMES == (*DIMS, *DERIVED, EMBED)
    assert set(DERIVED) == {"dense", "expert", "batch",  # + hybrid sharding's (test_hybrid.py)
                            "dense_shard", "expert_shard", "dp_replicate"}
    assert Grid.from_config(ParallelConfig()).group_names() == list(GROUP_NAMES)
    with pytest.raises(KeyError, match="no group named 'metrics'"):
        Grid.named_dims("metrics")


def test_members_of_and_index_in_are_the_arithmetic():
    par = ParallelConfig(tp=2, cp=2, ep=2, dp=2)
    for r in (0, 5, 11, 15):
        g = Grid.from_config(par, r)
        for name in g.group_names():
            m = g.members(Grid.named_dims(name))
            assert g.members_of(name) == m == g.members_of(name, r)
            assert g.index_in(name) == m.index(r)
    g = Grid.from_config(ParallelConfig(tp=2, dp=2))
    assert g.index_in("dp", 3) == 1 and g.index_in("tp", 3) == 1 and g.index_in("pp", 3) == 0


def test_unconnected_grid_refuses_groups():
    """No silent fallback: a multi-member group without a process group would go to WORLD."""
    g = Grid.from_config(ParallelConfig(tp=2, dp=2), rank=1)
    assert not g.connected
    for name in ("tp", "dp", "pp", "dense"):  # single-member groups too: connect() first
        with pytest.raises(NotConnected, match=r"connect\(traffic\)"):
            g[name]
    assert g.members_of("tp") == (0, 1)  # the arithmetic still works


def test_one_rank_grid_connects_without_a_process_group():
    from fived.comm.ops import Traffic

    g = Grid.from_config(ParallelConfig()).connect(Traffic())
    assert g.connected
    for name in g.group_names():
        assert g[name].size == 1 and g[name].pg is None and g[name].rank == 0
    with pytest.raises(KeyError, match="no group named"):
        g["metrics"]


def _connected(rank: int, world: int, par: ParallelConfig) -> dict:
    from fived.comm.ops import Traffic

    g = Grid.from_config(par, rank).connect(Traffic())
    return {name: (g[name].ranks, g[name].rank, g[name].pg is not None,
                   g.members_of(name), g.index_in(name)) for name in g.group_names()}


def test_connected_groups_match_the_arithmetic():
    par = ParallelConfig(tp=2, dp=2)
    for rank, groups in enumerate(run_ranks(_connected, 4, par)):
        for name, (ranks, index, has_pg, members, idx) in groups.items():
            assert ranks == members and index == idx, (rank, name)
            assert has_pg == (len(ranks) > 1), (rank, name)


def test_the_embedding_group_is_each_pipelines_two_ends():
    """pp 0 and pp − 1 of each pipeline (same other coordinates); the middle stages and every
    rank of a V-shaped schedule (both ends on pp 0) are groups of one."""
    par = ParallelConfig(pp=4, tp=2)
    g = Grid.from_config(par)
    for r in range(8):
        c = g.coords(r)
        want = ((g.rank_of(pp=0, tp=c["tp"]), g.rank_of(pp=3, tp=c["tp"]))
                if c["pp"] in (0, 3) else (r,))
        assert g.members_of("embed", r) == want
    parts = g.partition(Grid.named_dims("embed"))
    assert sorted(len(p) for p in parts) == [1, 1, 1, 1, 2, 2]
    v = Grid.from_config(ParallelConfig(pp=2, schedule="zb-v", micro_batches=4))
    assert all(v.members_of("embed", r) == (r,) for r in range(2))
