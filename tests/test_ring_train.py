"""``--collectives ring``: the data-parallel gradient reduction (and ZeRO-1/2's parameter
all-gather) through fived's own send/recv ring (``fived.comm.ring``) gives the backend's losses
and gradients, and the bytes it records are the ledger's, to the byte."""

import pytest

from fived.config import ConfigError, ParallelConfig, preset, validate
from fived.ledger import verify
from fived.testing import grad_rel_diff, rel_diff, small_train, train_runs

MODEL = preset("tiny")
TOL = 1e-5


def _pairs(zeros, dp, **kw):
    train = small_train(steps=2)
    runs = []
    for z in zeros:
        for c in ("backend", "ring"):
            runs.append((MODEL, ParallelConfig(dp=dp, zero=z, collectives=c, **kw), train))
    return runs, train


def _check(runs, outs, train):
    for i in range(0, len(runs), 2):
        par_r = runs[i + 1][1]
        base, ring = outs[i], outs[i + 1]
        for s in ring["ranks"]:
            assert rel_diff(s["losses"], base["losses"]) < TOL, (par_r.describe(), par_r.zero)
            # the ledger (2(N−1)/N·S and friends) is what the ring sent, every rank
            assert verify.compare_record(MODEL, par_r, train.global_batch,
                                         s["history"][-1]) == [], par_r.zero
        assert grad_rel_diff(ring["grads"], base["grads"]) < TOL, par_r.zero
        # the bytes are the backend run's, group by group
        assert [s["history"][-1]["traffic"] for s in ring["ranks"]] == \
            [s["history"][-1]["traffic"] for s in base["ranks"]]


def test_ring_dp2_ddp_zero1_zero2():
    runs, train = _pairs((0, 1, 2), 2)
    _check(runs, train_runs(runs), train)


@pytest.mark.slow
def test_ring_dp4_ddp_zero3():
    runs, train = _pairs((0, 3), 4)
    _check(runs, train_runs(runs), train)


def test_collectives_flag_is_checked():
    with pytest.raises(ConfigError, match="collectives"):
        validate(MODEL, ParallelConfig(dp=2, collectives="mpi"))
