"""Pipeline parity, traffic and the bubble of the schedules' timelines.

Default (fast): pp=2 × every schedule (ZB-V, DualPipe-V included), pp=4 × 1F1B and ZB-H1,
each equal to the one-rank run to 1e-5 relative over 5 steps (losses) and in every
parameter's gathered first-step gradient;
pp bytes = activation + gradient bytes per boundary per micro-batch; one step's gradients
outside the training loop equal the one-rank gradients; the timeline of every schedule's action
lists, simulated from the data dependencies alone with unit costs, has exactly the bubble of the
formula (``schedules.bubble_formula`` and the ledger's ``bubble_fraction``); the split
schedules' deferred W gives the bits one ordinary backward gives. ``-m slow``: the full matrix
pp ∈ {2, 4} × every schedule × m ∈ {pp, 2pp}, alone, with dp=2 and with tp=2.

No assertion here reads a clock. The bubble the executor measures on real ranks (sleep-dominated
stage costs, against the same formula) is a figure, not a test: ``fived figures bubbles``.

Several layouts of one world size run in one spawn (``train_many``) to save process start-ups.
"""

import os
import sys
from dataclasses import replace
from fractions import Fraction

import pytest

from fived import schedules as pipeline_schedules
from fived.config import ParallelConfig, preset
from fived.ledger.bubble import bubble_fraction as ledger_bubble_fraction
from fived.parallel.pipeline.stage import stage_ids
from fived.testing import assemble_grads, grad_rel_diff, run_ranks, small_train

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import check_parity, gathered, one_rank  # noqa: E402
from pipeline_helpers import suite, train_many  # noqa: E402

MODEL = preset("tiny")


def _par(schedule: str, pp: int, m: int, **kw) -> ParallelConfig:
    v = 2 if schedule in ("interleaved",) + pipeline_schedules.V_SHAPED else 1
    return ParallelConfig(pp=pp, micro_batches=m, schedule=schedule, virtual_stages=v, **kw)


@pytest.fixture(scope="module")
def reference():
    """The one-rank run: losses, and the first step's gradients (the same step-0 batch and
    initial weights as ``grads_one_step``)."""
    return one_rank(MODEL, small_train())


def _assert_parity(pars, out, reference):
    """``out``: per rank, per layout, the trained summary with its gradient pieces."""
    for i, par in enumerate(pars):
        check_parity(gathered([rank_out[i] for rank_out in out]), reference,
                     (par.describe(), par.schedule, par.micro_batches))


def _assert_pp_bytes(pars, out, tr=None):
    """Each rank sends, per micro-batch, one activation per outgoing forward boundary and one
    gradient per incoming one: act_bytes × (#stages it holds that are not last + not first),
    a boundary between two stages of the same rank (the V's bottom) sending nothing."""
    tr = tr or small_train()
    for i, par in enumerate(pars):
        v = par.virtual_stages
        nstages = par.pp * v
        mb = tr.global_batch // (par.dp * par.ep) // par.micro_batches
        act = mb * MODEL.seq_len * MODEL.hidden * 4
        for r, per_rank in enumerate(out[0][i]["history"][-1]["traffic_per_rank"]):
            pp_rank = r // (par.world_size // par.pp)
            stages = stage_ids(par, pp_rank)
            boundaries = sum((s < nstages - 1 and s + 1 not in stages)
                             + (s > 0 and s - 1 not in stages) for s in stages)
            assert per_rank["bytes"]["pp"] == boundaries * par.micro_batches * act, (par, r)


def _assert_grads(out, reference, model=MODEL, train=None):
    """One step's gradients (``grads_one_step`` on every rank), gathered, equal the one-rank
    first-step gradients: relative L2 per parameter, and elementwise to 1e-5 of its largest."""
    train = train or small_train()
    grads = assemble_grads([o["grads"] for o in out])
    assert grad_rel_diff(grads, reference["grads"]) < 1e-5
    for n, r in reference["grads"].items():
        assert (grads[n] - r).abs().max() <= 1e-5 * r.abs().max() + 1e-12, n
    tokens = train.global_batch * model.seq_len  # only the last stage holds the loss
    assert out[-1]["loss"] == pytest.approx(reference["losses"][0] * tokens, rel=1e-6)
    assert all(o["loss"] == 0.0 for o in out[:-1])


def _ms(schedule: str, pp: int) -> tuple[int, ...]:
    return (2 * pp,) if schedule == "dualpipe-v" else (pp, 2 * pp)


def _col(out, key, i):
    return [o[key][i] for o in out]


def test_pp2(reference):
    """pp=2: every schedule equals one rank over 5 steps (and ZB-V under full recompute, where
    every B is the whole backward); pp bytes; one step's gradients
    (ZB-H1, 4 micro-batches) equal one rank's."""
    pars = [_par(s, 2, 4 if s == "dualpipe-v" else 2) for s in pipeline_schedules.NAMES] + [
        _par("zb-h1", 2, 4), _par("zb-v", 2, 2, recompute="full")]
    out = run_ranks(suite, 2, MODEL, pars, small_train(), [_par("zb-h1", 2, 4)])
    trained = [o["train"] for o in out]
    _assert_parity(pars, trained, reference)
    _assert_pp_bytes(pars, trained)
    grads = _col(out, "grads", 0)
    _assert_grads(grads, reference)
    assert grads[0]["stats"]["peak_live"] == {0: 2} and grads[1]["stats"]["peak_live"] == {1: 2}


def test_pp4(reference):
    """pp=4: 1F1B and ZB-H1 equal one rank; 1F1B's measured live micro-batches are p − r."""
    pars = [_par("1f1b", 4, 4), _par("zb-h1", 4, 8)]
    out = run_ranks(suite, 4, MODEL, pars, small_train(), [_par("1f1b", 4, 8)])
    trained = [o["train"] for o in out]
    _assert_parity(pars, trained, reference)
    _assert_pp_bytes(pars, trained)
    grads = _col(out, "grads", 0)
    _assert_grads(grads, reference)
    assert [g["stats"]["peak_live"] for g in grads] == [{r: 4 - r} for r in range(4)]


# ---------------------------------------------------------------- the bubble of the timeline
# Each schedule's action lists on a simulated clock with unit costs (F = 1, B = 2; F = B = W = 1
# where the backward is split): every rank runs its F/B/W in its list's order, each action as
# soon as its rank is free and its inputs exist: F(mb, s) after F(mb, s − 1) (the activation),
# B(mb, s) after F(mb, s) and B(mb, s + 1) (the output gradient), W(mb, s) after B(mb, s). The
# lists' SEND/RECV actions are not consulted: this is the timeline of the data alone.

def _exact_bubble(name: str, p: int, m: int, v: int) -> Fraction:
    """Idle slots / (p · makespan), exactly (ZB-H1: m ≥ p, where its W's fill 1F1B's cool-down)."""
    if name in ("gpipe", "1f1b"):
        return Fraction(p - 1, m + p - 1)
    if name == "interleaved":
        return Fraction(p - 1, v * m + p - 1)
    if name == "zb-h1":
        assert m >= p
        return Fraction(p - 1, 3 * m + p - 1)
    return 1 - Fraction(6 * m, max(6 * m + p - 1, 4 * m + 4 * p - 2))  # the V's, 6m units each


def _timeline(sched: pipeline_schedules.Schedule) -> tuple[Fraction, dict[pipeline_schedules.Action, int]]:
    """(bubble fraction, start of every F/B/W) of ``sched`` run from its data dependencies."""
    cost = {"F": 1, "B": 1, "W": 1} if sched.split_backward else {"F": 1, "B": 2}
    last = sched.stages - 1

    def inputs(a: pipeline_schedules.Action) -> list[pipeline_schedules.Action]:
        if a.kind == "F":
            return [pipeline_schedules.Action("F", a.mb, a.stage - 1)] if a.stage > 0 else []
        if a.kind == "B":
            return [pipeline_schedules.Action("F", a.mb, a.stage)] + (
                [pipeline_schedules.Action("B", a.mb, a.stage + 1)] if a.stage < last else [])
        return [pipeline_schedules.Action("B", a.mb, a.stage)]

    lists = [sched.compute(r) for r in range(sched.pp)]
    pos, free = [0] * sched.pp, [0] * sched.pp
    start: dict[pipeline_schedules.Action, int] = {}
    end: dict[pipeline_schedules.Action, int] = {}
    while any(pos[r] < len(lists[r]) for r in range(sched.pp)):
        moved = False
        for r, acts in enumerate(lists):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                need = inputs(a)
                if any(n not in end for n in need):
                    break  # waits for another rank
                start[a] = max([free[r]] + [end[n] for n in need])
                end[a] = free[r] = start[a] + cost[a.kind]
                pos[r] += 1
                moved = True
        assert moved, (sched.name, "deadlock", pos)
    makespan = max(free)
    work = sum(cost[a.kind] for acts in lists for a in acts)
    return Fraction(sched.pp * makespan - work, sched.pp * makespan), start


TIMELINES = {  # (p, m, v) per schedule: m below, at and above p (and 2p − 1 for the V's)
    "gpipe": [(p, m, 1) for p in (2, 3, 4) for m in (1, p, 2 * p + 1)],
    "1f1b": [(p, m, 1) for p in (2, 3, 4) for m in (1, p, 2 * p + 1)],
    "interleaved": [(p, m, v) for p in (2, 3, 4) for m in (p, 2 * p) for v in (2, 3)],
    "zb-h1": [(p, m, 1) for p in (2, 3, 4) for m in (p, 2 * p + 1)],
    "zb-v": [(p, m, 2) for p in (2, 3, 4) for m in (1, p, 2 * p - 1, 2 * p + 2)],
    "dualpipe-v": [(p, m, 2) for p in (2, 3, 4) for m in (2 * p, 2 * p + 1, 3 * p)],
}


@pytest.mark.parametrize("name", pipeline_schedules.NAMES)
def test_simulated_timeline_has_the_formula_bubble(name):
    """The bubble of each schedule's timeline is the formula's, exactly (as a fraction), and the
    one ``schedules.bubble_formula`` and the ledger (``fived.ledger.bubble``) give; the lists'
    own messages (``schedules.simulate``, the executor's order) start no action before its data
    and do not lengthen the step (DualPipe-V's full backwards send their input gradient after
    their W, as the executor's fused backward does: later actions, the same makespan)."""
    assert set(TIMELINES) == set(pipeline_schedules.NAMES)
    for p, m, v in TIMELINES[name]:
        sched = pipeline_schedules.build(name, p, m, v)
        pipeline_schedules.check(sched)
        got, start = _timeline(sched)
        want = _exact_bubble(name, p, m, v)
        assert got == want, (name, p, m, v, got, want)
        assert float(got) == pytest.approx(pipeline_schedules.bubble_formula(name, p, m, v), abs=1e-12)
        par = ParallelConfig(pp=p, micro_batches=m, schedule=name, virtual_stages=v)
        assert float(got) == pytest.approx(ledger_bubble_fraction(par), abs=1e-12)
        sim = pipeline_schedules.simulate(sched)  # the lists with their messages, as the executor runs them
        assert all(s >= start[a] for r in sim.spans for a, s, _ in r if a.kind in pipeline_schedules.COMPUTE)
        assert float(got) == pytest.approx(sim.bubble_fraction(), abs=1e-12)


# ---------------------------------------------------------------- the full matrix (slow)
# 8 layers so that interleaved pp=4 has a layer per virtual stage; 16 sequences so that
# dp=2 × 2·pp micro-batches divide the batch.

MODEL8 = replace(MODEL, layers=8)
TRAIN16 = small_train(global_batch=16)


@pytest.fixture(scope="module")
def reference8():
    return one_rank(MODEL8, TRAIN16)


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2, 4])
def test_matrix_pp_alone(reference8, pp):
    pars = [_par(s, pp, m) for s in pipeline_schedules.NAMES for m in _ms(s, pp)]
    out = run_ranks(train_many, pp, MODEL8, pars, TRAIN16, timeout=1800)
    _assert_parity(pars, out, reference8)
    _assert_pp_bytes(pars, out, TRAIN16)


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2, 4])
def test_matrix_pp_dp2(reference8, pp):
    pars = [_par(s, pp, m, dp=2) for s in pipeline_schedules.NAMES for m in _ms(s, pp)]
    out = run_ranks(train_many, 2 * pp, MODEL8, pars, TRAIN16, timeout=1800)
    _assert_parity(pars, out, reference8)
    _assert_pp_bytes(pars, out, TRAIN16)


@pytest.mark.slow
@pytest.mark.parametrize("pp,dp,sp", [(2, 1, False), (4, 1, False), (2, 1, True), (2, 2, False),
                                      (2, 2, True)])
def test_matrix_pp_tp2(reference8, pp, dp, sp):
    pars = [_par(s, pp, m, dp=dp, tp=2, sequence_parallel=sp) for s in pipeline_schedules.NAMES
            for m in _ms(s, pp)]
    out = run_ranks(train_many, pp * dp * 2, MODEL8, pars, TRAIN16, timeout=1800)
    _assert_parity(pars, out, reference8)


def test_bench_pp_runs(capsys):
    """``fived bench pp`` times every schedule that has a torch peer (ZB-V against
    ``ScheduleZBVZeroBubble``, DualPipe-V against ``ScheduleDualPipeV``), and both sides
    compute the same gradients (so the ratio compares the same work)."""
    import json

    from fived.bench import pp as bench

    assert bench.main(["--pp", "2", "--micro-batches", "4", "--layers", "4", "--reps", "1",
                       "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    from fived.bench import schema

    schema.validate(out)  # the fived.bench document: a fived row and its torch peer row each
    fived = [r for r in out["rows"] if r["implementation"] == "fived"]
    assert [r["variant"] for r in fived] == ["gpipe", "1f1b", "interleaved", "zb-v",
                                             "dualpipe-v"]
    for r in fived:
        assert r["step_s"] > 0 and r["ratio"] > 0
        assert r["extra"]["grad_rel_gap"] < 1e-5, r


def test_deferred_weight_grads_are_autograds():
    """The split forward + deferred W (``runtime._weight_grads``) gives the bits one ordinary
    backward gives, onto an existing gradient too, with a weight used by two linears (its dW
    summed first, as autograd sums a leaf's gradients) and its post-accumulate hook run once."""
    import torch
    import torch.nn.functional as F

    from fived.parallel.pipeline.runtime import _SplitLinear, _weight_grads

    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 4, generator=gen))
    u = torch.nn.Parameter(torch.randn(3, 6, generator=gen))
    x = torch.randn(2, 5, 4, generator=gen, requires_grad=True)  # a stage input
    g = torch.randn(2, 5, 3, generator=gen)
    fired = []
    w.register_post_accumulate_grad_hook(lambda p: fired.append("w"))

    def model(x):
        return F.linear(torch.tanh(F.linear(x, w)) + F.linear(2 * x, w), u)

    model(x).backward(g)
    model(x).backward(g)  # the second micro-batch accumulates
    want = [w.grad.clone(), u.grad.clone()]
    fired.clear()
    w.grad = u.grad = None
    for _ in range(2):
        mode = _SplitLinear({id(w), id(u)})
        with mode:
            out = model(x)
        before = [None if p.grad is None else p.grad.clone() for p in (w, u)]
        torch.autograd.backward(out, g, inputs=[x] + [r[1] for r in mode.records])
        for p, b in zip((w, u), before):  # B computed no weight gradient
            assert p.grad is None if b is None else torch.equal(p.grad, b)
        _weight_grads(mode.records)
    assert torch.equal(w.grad, want[0]) and torch.equal(u.grad, want[1])
    assert fired == ["w", "w"]  # once per W, though w served two linears
