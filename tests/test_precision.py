"""Mixed precision: bf16 keeps fp32 masters and tracks the fp32 loss; fp16 skips overflowing
steps (and says so); the loss scaler's arithmetic."""

from __future__ import annotations

import pytest
import torch

from fived.config import ParallelConfig, preset
from fived.parallel.precision import LossScaler, bytes_per_param
from fived.testing import rel_diff, run_ranks, small_train, train_layout

MODEL = preset("tiny")
BF16_TOLERANCE = 2e-2  # relative, per step, over 5 steps (measured: ~2e-4)


@pytest.fixture(scope="module")
def reference():
    return train_layout(MODEL, ParallelConfig(), small_train())[0]


@pytest.mark.parametrize("zero", [0, 3])
def test_bf16_tracks_fp32(reference, zero):
    out = train_layout(MODEL, ParallelConfig(dp=2, zero=zero, precision="bf16"), small_train())
    for s in out:
        assert rel_diff(s["losses"], reference["losses"]) < BF16_TOLERANCE
        assert s["losses"][-1] < s["losses"][0]
        m = s["history"][-1]["memory"]
        assert m["master"] == 2 * m["params"]  # fp32 master = 4 bytes vs 2


def _master_semantics(rank: int, world: int) -> dict:
    from fived.train.trainer import Trainer

    t = Trainer(MODEL, ParallelConfig(dp=world, precision="bf16", zero=1), small_train(steps=3),
                rank, world)
    for step in range(3):
        t.step(step)
    e = t.engine
    masters = [b.master for b in e.buckets]
    full = [b.param_shard for b in e.buckets]
    return {
        "param_dtypes": {str(p.dtype) for p in e.params},
        "master_dtypes": {str(m.dtype) for m in masters},
        "opt_dtypes": {str(x.dtype) for x in e.opt.m + e.opt.v},
        # the params are the masters rounded to bf16 ...
        "rounded": all(torch.equal(m.to(torch.bfloat16), p) for m, p in zip(masters, full)),
        # ... and the masters hold bits bf16 cannot (they are not bf16 values themselves)
        "finer": any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters),
    }


def test_bf16_master_weights_stay_fp32():
    r = run_ranks(_master_semantics, 2)[0]
    assert r["param_dtypes"] == {"torch.bfloat16"}
    assert r["master_dtypes"] == {"torch.float32"} and r["opt_dtypes"] == {"torch.float32"}
    assert r["rounded"] and r["finer"]


def _fp16_overflow(rank: int, world: int) -> dict:
    from fived.train.trainer import Trainer

    t = Trainer(MODEL, ParallelConfig(dp=world, precision="fp16"), small_train(steps=3),
                rank, world)
    t.engine.scaler.scale = 2.0**40  # fp16 gradients overflow at once
    before = [b.master.clone() for b in t.engine.buckets]
    recs = [t.step(0)]
    unchanged = all(torch.equal(a, b.master) for a, b in zip(before, t.engine.buckets))
    scale_after = t.engine.scaler.scale
    t.engine.scaler.scale = 2.0**10
    recs.append(t.step(1))
    return {"skipped": [r["skipped"] for r in recs], "unchanged": unchanged,
            "scale_after": scale_after, "losses": [r["loss"] for r in recs]}


def test_fp16_overflow_skips_the_step():
    r = run_ranks(_fp16_overflow, 2)[0]
    assert r["skipped"] == [True, False]
    assert r["unchanged"]
    assert r["scale_after"] == 2.0**39
    assert all(torch.isfinite(torch.tensor(r["losses"])))


def test_loss_scaler_backoff_and_growth():
    s = LossScaler(init_scale=1024, growth_interval=2)
    s.update(True)
    assert s.scale == 512 and s.skipped == 1
    s.update(False)
    assert s.scale == 512
    s.update(False)
    assert s.scale == 1024


def test_bytes_per_param_by_mode():
    assert sum(bytes_per_param("fp32").values()) == 16
    assert sum(bytes_per_param("bf16", "fp32").values()) == 18
    assert sum(bytes_per_param("bf16", "bf16").values()) == 16
