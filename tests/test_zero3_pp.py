"""ZeRO-3 with pipeline parallelism: the executor gathers a stage's chunks once per step or once
per micro-batch (``--zero3-pp-gather step|micro``).

Each layout trains 3 steps of ``tiny`` with losses and gathered first-step gradients equal to
the one-rank run, and every rank's model-state bytes and bytes sent per group, on every step,
equal the ledger's (``fived.ledger.verify.compare_record``, what ``fived ledger --check``
runs). Default: pp2·dp2 with 1F1B (step and micro), ZB-V (step) and DualPipe-V (micro) in one
spawn, and the gather counts of the two modes against each other. ``-m slow``: every schedule
× both modes, pp2·dp2·tp2, and full recompute.
"""

from __future__ import annotations

import os
import sys

import pytest

from fived import schedules
from fived.config import ParallelConfig, preset, validate
from fived.ledger import traffic, verify
from fived.testing import run_ranks, small_train

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import check_parity, gathered, one_rank  # noqa: E402
from pipeline_helpers import train_many  # noqa: E402

MODEL = preset("tiny")
TRAIN = small_train(steps=3)


def _par(schedule: str, gather: str, pp: int = 2, dp: int = 2, **kw) -> ParallelConfig:
    v = 2 if schedule in ("interleaved",) + schedules.V_SHAPED else 1
    m = 2 * pp if schedule == "dualpipe-v" else pp
    return ParallelConfig(pp=pp, dp=dp, zero=3, zero3_pp_gather=gather, schedule=schedule,
                          virtual_stages=v, micro_batches=m, **kw)


@pytest.fixture(scope="module")
def reference():
    return one_rank(MODEL, TRAIN)


def _check(pars: list[ParallelConfig], reference) -> None:
    world = pars[0].world_size
    out = run_ranks(train_many, world, MODEL, pars, TRAIN, timeout=900)
    for i, par in enumerate(pars):
        check_parity(gathered([o[i] for o in out]), reference,
                     (par.describe(), par.schedule, par.zero3_pp_gather))
        for rec in out[0][i]["history"]:
            assert verify.compare_record(MODEL, par, TRAIN.global_batch, rec) == [], (
                par.schedule, par.zero3_pp_gather, rec["step"])


def test_zero3_pp_is_accepted():
    for gather in ("step", "micro"):
        validate(MODEL, _par("1f1b", gather), TRAIN, 4)


def test_zero3_pp2_dp2_parity_and_ledger(reference):
    _check([_par("1f1b", "step"), _par("1f1b", "micro"), _par("zb-v", "step"),
            _par("dualpipe-v", "micro")], reference)


def test_gathers_per_step_vs_per_micro_batch():
    """Per step: one all-gather of each chunk; per micro-batch: one per F and one per B (2m)."""
    par = _par("1f1b", "micro")
    micro = [c for c in traffic.dp_traffic(MODEL, par) if c.op == "all_gather"]
    step = [c for c in traffic.dp_traffic(MODEL, _par("1f1b", "step"))
            if c.op == "all_gather"]
    assert sum(c.count for c in micro) == 2 * par.micro_batches * sum(c.count for c in step)
    assert sum(c.bytes for c in micro) == 2 * par.micro_batches * sum(c.bytes for c in step)


@pytest.mark.slow
@pytest.mark.parametrize("gather", ["step", "micro"])
def test_matrix_every_schedule(reference, gather):
    _check([_par(s, gather) for s in schedules.NAMES], reference)


@pytest.mark.slow
def test_zero3_pp2_dp2_tp2_and_recompute(reference):
    _check([_par("1f1b", "micro", tp=2), _par("zb-v", "step", tp=2)], reference)
    _check([_par("dualpipe-v", "micro", recompute="full"),
            _par("zb-h1", "step", recompute="full")], reference)
