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


class _Probe:
    """A run hook: at each step's start, the bytes behind the fp8 weights (their compute-dtype
    storage: freed under the gather) and whether each is provided cast; at step 2, a
    forward-only pass's loss (what evaluation runs) on that step's batch."""

    def __init__(self) -> None:
        self.storage: list[int] = []
        self.provided: list[bool] = []
        self.forward: float | None = None

    def on_step_start(self, trainer, step):
        import torch

        from fived.ledger.params import fp8_weight
        from fived.model import fp8 as fp8_mod

        named = [(n, p) for n, p in trainer.stage.named_parameters() if fp8_weight(n)]
        self.storage.append(sum(p.untyped_storage().nbytes() for _, p in named))
        self.provided.append(all(id(p) in fp8_mod._PROVIDED for _, p in named))
        if step == 2:
            with torch.no_grad():
                loss = trainer.forward_only(*trainer.local_data(step))
            self.forward = trainer.global_loss(loss)
            trainer.engine.end_forward()


def _behaviour(rank, world, runs):
    """Each (model, layout, train, plant a NaN at step 2): losses, skipped steps and the probe."""
    from fived.testing import OnGrads
    from fived.train.trainer import train_rank

    def nan(trainer, step):
        if trainer.rank == 1 and step == 2:
            trainer.engine.owned_grads()[0].view(-1)[0] = float("nan")

    out = []
    for m, p, t, bad in runs:
        probe = _Probe()
        s = train_rank(rank, world, m, p, t, show=False,
                       hooks=[probe] + ([OnGrads(nan)] if bad else []))
        out.append({"losses": s["losses"], "skipped": [h["skipped"] for h in s["history"]],
                    "storage": probe.storage, "provided": probe.provided,
                    "forward": probe.forward})
    return out


def test_zero1_fp8_gather_frees_bf16_resumes_both_ways_and_skips_a_bad_step(tmp_path):
    """bf16 dp2 ZeRO-1 tensorwise, with the fp8 gather against --no-fp8-gather: the fp8
    weights' compute-dtype storage is freed (0 bytes at every step's start; 4 KiB+ without the
    gather) and every one of them is provided cast; the losses equal bit for bit (the gathered
    cast is the cast the linear makes of the whole weight); a checkpoint saved with the gather
    resumes bit-exactly with it and without it, and one saved without it resumes with it; the
    forward-only loss (evaluation's pass) is the same; a NaN planted on rank 1 at step 2 skips
    that step alike under both (the casts stay those of step 1's update)."""
    from fived.testing import run_ranks, small_train

    on = ParallelConfig(dp=2, zero=1, precision="bf16", fp8="tensorwise")
    off = replace(on, fp8_gather=False)
    t = small_train(steps=5)
    d_on, d_off = str(tmp_path / "on"), str(tmp_path / "off")
    runs = [(TINY, on, t, False), (TINY, off, t, False),
            (TINY, on, replace(t, stop_after=3, save_dir=d_on), False),
            (TINY, off, replace(t, stop_after=3, save_dir=d_off), False),
            (TINY, on, replace(t, resume=d_on), False),
            (TINY, off, replace(t, resume=d_on), False),
            (TINY, on, replace(t, resume=d_off), False),
            (TINY, on, t, True), (TINY, off, t, True)]
    full, ref, first_on, first_off, on_on, on_off, off_on, bad_on, bad_off = run_ranks(
        _behaviour, 2, runs, timeout=600)[0]
    assert full["storage"] == [0] * 5 and all(full["provided"]), full
    assert min(ref["storage"]) > 4096 and not any(ref["provided"]), ref
    assert full["losses"] == ref["losses"], (full["losses"], ref["losses"])
    assert full["forward"] == ref["forward"] and full["forward"] is not None
    for first in (first_on, first_off):
        assert first["losses"] == full["losses"][:3]
    for rest in (on_on, on_off, off_on):
        assert rest["losses"] == full["losses"][3:], (rest["losses"], full["losses"])
    assert on_on["storage"] == [0, 0] and all(on_on["provided"])
    assert bad_on["skipped"] == [False, False, True, False, False]
    assert bad_on["losses"] == bad_off["losses"] and bad_on["skipped"] == bad_off["skipped"]
    assert bad_on["losses"][3] != full["losses"][3]
