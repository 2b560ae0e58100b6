"""Mixed precision: bf16 data-parallel runs equal the one-rank bf16 run and track the fp32 run;
bf16 keeps fp32 masters; fp16 skips overflowing steps (and says so); the loss scaler's
arithmetic.

Two parities per bf16 layout (dp=2, ZeRO 0-3, with and without accumulation), each on the
losses of all 5 steps on every rank and every parameter's full first-step gradient gathered by
global name (relative L2 norm, ``check_close``):

* against the one-rank bf16 run whose micro-batches are the layout's local micro-batches
  (``micro_batches = dp · micro``): the same bf16 arithmetic per backward, the fp32 gradient
  buffer summing the pieces in either case, so the gap is fp32 rounding only;
* against the one-rank fp32 run: the real bf16 gap (bf16 matmuls and activations).

Each tolerance is at most 10× the gap measured on this tiny model (in the comment beside it).
(A one-rank bf16 run with one micro-batch is no reference: its embedding gradient accumulates in
bf16 over 8 sequences, 3.1e-2 away from dp=2's two fp32-summed halves.)
The bf16 runs, the master-weight probe and the fp16 overflow probe share one 2-rank spawn.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from fived.config import ParallelConfig, preset
from fived.parallel.precision import LossScaler, bytes_per_param
from fived.testing import rank_runs, run_ranks, small_train

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import check_close, gathered, one_rank  # noqa: E402,I001

MODEL = preset("tiny")
TRAIN = small_train()
# bf16 dp layout vs the one-rank bf16 run of the same local micro-batches, ZeRO 0-3
PARITY_LOSS_TOL = 5e-7  # measured 5.0e-8 (the loss's sum over ranks in another order)
PARITY_GRAD_TOL = 1e-6  # measured 0: bit-equal (a floor of fp32 rounding for a sum's order)
# bf16 vs fp32, one rank (2 or 4 micro-batches) or dp=2 ZeRO 0-3
FP32_LOSS_TOL = 1e-3  # measured 1.7e-4 to 1.8e-4 over the 5 steps
FP32_GRAD_TOL = 5e-2  # measured 8.8e-3 to 9.0e-3 (worst: the k/q projections, the embedding)

BF16 = [ParallelConfig(dp=2, zero=z, micro_batches=m, precision="bf16")
        for z, m in ((0, 1), (1, 2), (2, 2), (3, 1))]


@pytest.fixture(scope="module")
def references():
    """One-rank runs in this process: fp32, and bf16 with 2 and 4 micro-batches."""
    out = {"fp32": one_rank(MODEL, TRAIN)}
    for m in (2, 4):
        out[m] = gathered([_one_rank_bf16(m)])
    return out


def _one_rank_bf16(micro: int) -> dict:
    from fived.testing import train_recording

    return train_recording(0, 1, MODEL, ParallelConfig(precision="bf16", micro_batches=micro),
                           TRAIN)


def _world2(rank: int, world: int) -> dict:
    """Everything this module runs on 2 ranks, in one spawn."""
    return {"runs": rank_runs(rank, world, [(MODEL, p, TRAIN) for p in BF16]),
            "master": _master_semantics(rank, world), "fp16": _fp16_overflow(rank, world)}


@pytest.fixture(scope="module")
def world2():
    per_rank = run_ranks(_world2, 2, timeout=600)
    return {"runs": [gathered([r["runs"][i] for r in per_rank]) for i in range(len(BF16))],
            "master": per_rank[0]["master"], "fp16": per_rank[0]["fp16"]}


IDS = [f"zero{p.zero}-m{p.micro_batches}" for p in BF16]


@pytest.mark.parametrize("i", range(len(BF16)), ids=IDS)
def test_bf16_dp_equals_one_rank_bf16(references, world2, i):
    par = BF16[i]
    ref = references[par.dp * par.micro_batches]
    check_close(world2["runs"][i], ref, PARITY_LOSS_TOL, PARITY_GRAD_TOL, par)


@pytest.mark.parametrize("i", range(len(BF16)), ids=IDS)
def test_bf16_tracks_fp32(references, world2, i):
    out = world2["runs"][i]
    check_close(out, references["fp32"], FP32_LOSS_TOL, FP32_GRAD_TOL, BF16[i])
    for s in out["ranks"]:
        assert s["losses"][-1] < s["losses"][0]
        m = s["history"][-1]["memory"]
        # fp32 masters (4 bytes a parameter against bf16's 2), sharded from ZeRO-1 on, the
        # params from ZeRO-3 on
        assert m["master"] * (2 if BF16[i].zero in (1, 2) else 1) == 2 * m["params"], m


def test_bf16_one_rank_tracks_fp32(references):
    for m in (2, 4):
        check_close(references[m], references["fp32"], FP32_LOSS_TOL, FP32_GRAD_TOL, m)


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


def test_bf16_master_weights_stay_fp32(world2):
    r = world2["master"]
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


def test_fp16_overflow_skips_the_step(world2):
    r = world2["fp16"]
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
