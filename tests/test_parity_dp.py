"""Data-parallel parity: dp=2 and dp=4 give the one-rank losses (fp32, 1e-5 relative)."""

import pytest

from fived.comm.volume import bytes_sent
from fived.config import ParallelConfig, preset
from fived.testing import rel_diff, small_train, train_layout

MODEL = preset("tiny")


@pytest.fixture(scope="module")
def reference():
    return train_layout(MODEL, ParallelConfig(), small_train())[0]


@pytest.mark.parametrize("dp,micro", [(2, 1), (4, 2)])
def test_dp_matches_one_rank(reference, dp, micro):
    out = train_layout(MODEL, ParallelConfig(dp=dp, micro_batches=micro), small_train())
    for rank_summary in out:
        assert rel_diff(rank_summary["losses"], reference["losses"]) < 1e-5
    # the loss falls over the 5 steps
    assert reference["losses"][-1] < reference["losses"][0]


def test_dp_traffic_is_ring_allreduce_of_grads():
    out = train_layout(MODEL, ParallelConfig(dp=2), small_train(steps=2))
    for s in out:
        last = s["history"][-1]
        grad_bytes = last["memory"]["grads"]
        assert last["traffic"]["dense"] == bytes_sent("all_reduce", grad_bytes, 2)
        assert last["traffic"]["dense"] == 2 * (2 - 1) / 2 * grad_bytes
