"""ZeRO-1/2's fp8 parameter all-gather (``fived.parallel.data.zero12``, ``fp8.Fp8Gather``): the
fp8 linears' weights kept as the owned compute-dtype shard and the whole e4m3 cast with its
scales (the compute-dtype buffer freed), gathered in e4m3 after every step; the layout equals
the one-rank fp8 run of the same recipe; the traffic and the model states against the ledger.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest

from fived.config import ParallelConfig, TrainConfig, preset

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import check_parity, fp8_reference, train_runs  # noqa: E402,I001

TINY = replace(preset("tiny"), layers=2, seq_len=16)
TRAIN = TrainConfig(steps=3, global_batch=4, lr=3e-3, warmup=1, seed=7)


@pytest.mark.parametrize("zero,recipe", [(1, "tensorwise"), (2, "blockwise"),
                                         pytest.param(1, "blockwise", marks=pytest.mark.slow),
                                         pytest.param(2, "tensorwise", marks=pytest.mark.slow)])
def test_zero12_fp8_gather_equals_one_rank_and_the_ledger(zero, recipe):
    """dp2 ZeRO-1/2 under --fp8 tensorwise and blockwise with the fp8 gather equal the
    one-rank fp8 run (losses of 3 steps and first-step gradients to 1e-5, fp32 around the
    products); every rank's traffic of every step and its model states equal the ledger's to
    the byte; the fp8 buckets' gather is a quarter of the fp32 gather's bytes."""
    from fived.ledger.memory import model_states
    from fived.ledger.traffic import step_bytes, step_traffic

    on = ParallelConfig(dp=2, zero=zero, precision="fp32", fp8=recipe)
    (out,) = train_runs([(TINY, on, TRAIN)])
    check_parity(out, fp8_reference(TINY, recipe, 2, TRAIN), on.describe())
    want = step_bytes(TINY, on, 2)
    states = model_states(TINY, on)
    for s in out["ranks"]:
        for h in s["history"]:
            assert h["traffic"] == pytest.approx(want, rel=1e-12, abs=0), h
            assert {k: h["memory"][k] for k in states if k != "buffers"} == {
                k: v for k, v in states.items() if k != "buffers"}, (h["memory"], states)
    off = replace(on, fp8_gather=False)
    gathers = [sum(c.bytes for c in step_traffic(TINY, p, 2) if c.op == "all_gather"
                   and c.what == "updated params") for p in (on, off)]
    assert gathers[0] < 0.5 * gathers[1], gathers
