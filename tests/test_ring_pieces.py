"""The pipelined ring (``fived.comm.ring._Ring.run``) with many pieces per chunk: tiny
``PIECE_BYTES`` so every chunk travels as several pieces, uneven chunks, empty pieces (chunks
shorter than the piece count) — the results equal the exact sums and the bytes are the
formula's, on 2 and 3 members."""

import pytest
import torch

from fived.testing import run_ranks


def _ints(who: int, n: int, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + who)
    return torch.randint(-8, 9, (n,), generator=g).float()


def _rank(rank: int, world: int) -> list[str]:
    from fived.comm import ring
    from fived.comm.ops import Traffic
    from fived.config import ParallelConfig
    from fived.ranks.grid import Grid

    traffic = Traffic()
    g = Grid.from_config(ParallelConfig(dp=world), rank).connect(traffic)["dp"]
    bad = []
    for piece in (4, 12, 40):  # bytes: 1, 3 or 10 floats per piece
        ring.PIECE_BYTES = piece
        for n in (1, 2, 5, 7, 13, 64, 101):
            x = _ints(rank, n, n + piece)
            want = sum(_ints(j, n, n + piece) for j in range(world))
            traffic.reset()
            got = ring.ring_all_reduce(x.clone(), g)
            c = [len(p) for p in torch.arange(n).tensor_split(world)]
            sent = traffic.records[("dp", "all_reduce")].bytes
            if not torch.equal(got, want):
                bad.append(f"all_reduce n={n} piece={piece}")
            if sent != 4.0 * (2 * n - c[rank] - c[(rank + 1) % world]):
                bad.append(f"all_reduce bytes n={n} piece={piece}: {sent}")
            m = n * world  # reduce-scatter / all-gather of equal shards
            y = _ints(rank, m, 7 * n + piece)
            full = sum(_ints(j, m, 7 * n + piece) for j in range(world))
            if not torch.equal(ring.ring_reduce_scatter(y, g), full.chunk(world)[rank]):
                bad.append(f"reduce_scatter n={n} piece={piece}")
            z = _ints(rank, n, 3 * n + piece)
            if not torch.equal(ring.ring_all_gather(z, g),
                               torch.cat([_ints(j, n, 3 * n + piece) for j in range(world)])):
                bad.append(f"all_gather n={n} piece={piece}")
    big = torch.arange(300_000, dtype=torch.float32) * (rank + 1)  # default pieces: 2 per chunk on 2
    ring.PIECE_BYTES = 1 << 19
    if not torch.equal(ring.ring_all_reduce(big.clone(), g),
                       torch.arange(300_000, dtype=torch.float32) * sum(range(1, world + 1))):
        bad.append("all_reduce 1.2 MB")
    return bad


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_ring_pieces_match_the_sums(world):
    for bad in run_ranks(_rank, world, timeout=300):
        assert bad == []
