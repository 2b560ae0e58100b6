"""ZeRO-3's fp8 parameter all-gather (``fived.parallel.data.fp8``): the tensorwise fp8 linears'
weights gathered in e4m3 with scales whose amax is reduced over the shards (and tp), so the
layout equals the one-rank fp8 run of the same recipe; the traffic and the gathered bytes
against the ledger.

Mutations seen to fail (each restored): the amax all-reduce over the shard group removed
(``test_zero3_fp8_gather_equals_one_rank``: a weight held wholly by the other rank cast with
scale 1); the layout's fp8 split removed from the ledger only (the traffic and the state
checks: the bucket count and the gathered bytes differ); the shard cast's clamp replaced by
no clamp is not visible (no weight saturates: the scale puts the amax at ≤ 448 by construction).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest

from fived.config import ParallelConfig, TrainConfig, preset

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import TOL, train_runs  # noqa: E402,I001

TINY = replace(preset("tiny"), layers=2, seq_len=16)
TRAIN = TrainConfig(steps=3, global_batch=4, lr=3e-3, warmup=1, seed=7)


def _reference(model, recipe, micro):
    from fived.testing import gathered, train_recording

    par = ParallelConfig(precision="fp32", fp8=recipe, micro_batches=micro)
    return gathered([train_recording(0, 1, model, par, TRAIN)])


def _check(out, ref, what):
    from fived.testing import grad_rel_diff, rel_diff

    for s in out["ranks"]:
        d = rel_diff(s["losses"], ref["losses"])
        assert d < TOL, (what, "losses", d)
    g = grad_rel_diff(out["grads"], ref["grads"])
    assert g < TOL, (what, "gradients", g)


def _ledger_traffic(model, par, micro_batch):
    from fived.ledger.traffic import step_bytes

    return step_bytes(model, par, micro_batch)


def test_zero3_fp8_gather_equals_one_rank_and_the_ledger():
    """dp2 ZeRO-3 under --fp8 tensorwise, the fp8 gather on and off (one spawn): both equal the
    one-rank fp8 run (losses and first-step gradients to 1e-5, fp32 around the products); every
    rank's traffic of every step equals the ledger's to the byte; the dense group's bytes with
    the fp8 gather are those of the bf16-gather run less half... exactly: the fp8 weights'
    gathers at 1 byte instead of 4 (fp32), plus one all-reduce of the scales per bucket."""
    on = ParallelConfig(dp=2, zero=3, precision="fp32", fp8="tensorwise")
    off = replace(on, fp8_gather=False)
    outs = train_runs([(TINY, on, TRAIN), (TINY, off, TRAIN)])
    ref = _reference(TINY, "tensorwise", 2)
    for par, out in zip((on, off), outs):
        _check(out, ref, par.describe())
        want = _ledger_traffic(TINY, par, 2)
        for s in out["ranks"]:
            for h in s["history"]:
                assert h["traffic"] == pytest.approx(want, rel=1e-12, abs=0), (par.fp8_gather, h)
    dense_on = outs[0]["ranks"][0]["history"][-1]["traffic"]["dense"]
    dense_off = outs[1]["ranks"][0]["history"][-1]["traffic"]["dense"]
    assert dense_on < 0.75 * dense_off, (dense_on, dense_off)
