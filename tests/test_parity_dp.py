"""Data-parallel parity: dp=2 and dp=4 (2 micro-batches) against the one-rank run (fp32) — the
losses of all 5 steps on every rank (1e-5 relative) and every parameter's full first-step
gradient, gathered by global name (1e-5 relative in the L2 norm, ``check_parity``; a reduced
gradient off by 2× leaves the losses within 1e-5 but not the gradients) — and the dp=2 run's
traffic is the ring all-reduce of its gradients. One spawn per world size.
"""

import os
import sys

import pytest

from fived.comm.volume import bytes_sent
from fived.config import ParallelConfig, preset
from fived.testing import small_train

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import check_parity, one_rank, train_runs  # noqa: E402,I001

MODEL = preset("tiny")
TRAIN = small_train()
LAYOUTS = {2: ParallelConfig(dp=2, micro_batches=1), 4: ParallelConfig(dp=4, micro_batches=2)}


@pytest.fixture(scope="module")
def reference():
    ref = one_rank(MODEL, TRAIN)
    assert ref["losses"][-1] < ref["losses"][0]  # the loss falls over the 5 steps
    return ref


@pytest.fixture(scope="module")
def runs():
    cache: dict = {}

    def get(dp: int) -> dict:
        if dp not in cache:
            cache[dp] = train_runs([(MODEL, LAYOUTS[dp], TRAIN)])[0]
        return cache[dp]
    return get


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_matches_one_rank(reference, runs, dp):
    check_parity(runs(dp), reference, LAYOUTS[dp])


def test_dp_traffic_is_ring_allreduce_of_grads(runs):
    for s in runs(2)["ranks"]:
        last = s["history"][-1]
        grad_bytes = last["memory"]["grads"]
        assert last["traffic"]["dense"] == bytes_sent("all_reduce", grad_bytes, 2)
        assert last["traffic"]["dense"] == 2 * (2 - 1) / 2 * grad_bytes
