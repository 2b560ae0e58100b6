"""Every rank's step measurements are gathered on rank 0 alone (one gather a step, the cheapest
collective for it); the other ranks take rank 0's records at the end of the run, so every rank
still returns the same summary (``fived.train.metrics.MetricsProcessor.share``)."""

from __future__ import annotations

from fived.config import ParallelConfig, preset
from fived.testing import small_train, train_runs
from fived.train.metrics import WORLD_KEYS


def test_every_rank_returns_rank_zeros_measurements_of_every_rank():
    out = train_runs([(preset("tiny"), ParallelConfig(dp=2, zero=1),
                       small_train(steps=2))])[0]
    ranks = out["ranks"]
    first = ranks[0]["history"]
    assert len(first) == 2
    for rec in first:
        assert len(rec["memory_per_rank"]) == len(rec["rss_per_rank"]) == 2
        assert rec["memory"] == rec["memory_per_rank"][0]
        assert all(p["peak"] > 0 for p in rec["rss_per_rank"])  # each rank's own sample
    for summary in ranks[1:]:
        assert len(summary["history"]) == len(first)
        for mine, zero in zip(summary["history"], first):
            for k in WORLD_KEYS:
                assert mine.get(k) == zero.get(k), k
