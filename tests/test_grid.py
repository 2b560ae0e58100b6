"""The grid: coordinates, groups, derived groups, node boundaries."""

from fived.config import ParallelConfig
from fived.dist.grid import Grid


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
