"""Schedules as data, the checker, the bubble arithmetic and the partition (no processes)."""

import os
import sys
from dataclasses import replace

import pytest
import torch

from fived import schedules
from fived.config import ConfigError, ParallelConfig, preset
from fived.model import build_model
from fived.parallel.parallelize import parallelize_parts
from fived.parallel.pipeline.runtime import StageModel
from fived.parallel.pipeline.stage import balanced_split, partition, stage_ids

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import offline_grid  # noqa: E402

MATRIX = [(name, p, m) for name in schedules.NAMES for p in (2, 4) for m in (p, 2 * p)
          if not (name == "dualpipe-v" and m < 2 * p)] + [
    ("dualpipe-v", p, m) for p in (2, 3, 4) for m in (2 * p + 1, 4 * p)] + [
    ("zb-v", p, m) for p in (3, 4, 8) for m in range(1, 2 * p + 2)]


def _v(name: str) -> int:
    return 2 if name in ("interleaved",) + schedules.V_SHAPED else 1


@pytest.mark.parametrize("name,p,m", MATRIX)
def test_every_schedule_passes_the_checker(name, p, m):
    schedules.check(schedules.build(name, p, m, _v(name)))


@pytest.mark.parametrize("name,p,m", MATRIX + [("1f1b", 4, 16), ("zb-h1", 3, 5),
                                                ("interleaved", 4, 16), ("gpipe", 3, 7)])
def test_idle_slots_of_the_action_lists_equal_the_formula(name, p, m):
    v = _v(name)
    t = schedules.simulate(schedules.build(name, p, m, v))
    assert t.bubble_fraction() == pytest.approx(schedules.bubble_formula(name, p, m, v), abs=1e-12)
    assert t.bubble_relative() == pytest.approx(schedules.bubble_relative_formula(name, p, m, v),
                                                abs=1e-12)


def test_bubble_formulas():
    p, m = 4, 8
    assert schedules.bubble_formula("gpipe", p, m) == (p - 1) / (m + p - 1)
    assert schedules.bubble_formula("1f1b", p, m) == (p - 1) / (m + p - 1)
    assert schedules.bubble_relative_formula("interleaved", p, m, 2) == pytest.approx((p - 1) / (2 * m))
    # ZB-H1: bubble (p-1)(F+B-W) instead of (p-1)(F+B+W): a third of 1F1B's idle slots
    zb = schedules.simulate(schedules.build("zb-h1", p, m))
    one = schedules.simulate(schedules.build("1f1b", p, m))
    assert sum(zb.idle) * 3 == sum(one.idle)


def test_v_schedules():
    """ZB-V / DualPipe-V: rank r holds stages r and 2p−1−r; the hand-off at the V's bottom is
    local; with m ≥ 2p − 1 the idle slots are p − 1 per rank (a sixth of 1F1B's per unit of
    stage work), and the live chunk activations peak at 2p (ZB-V) and 2p + 1 (DualPipe-V)."""
    p, m = 4, 8
    for name in schedules.V_SHAPED:
        s = schedules.build(name, p, m, 2)
        assert [sorted({a.stage for a in acts}) for acts in s.ranks] == [
            [r, 2 * p - 1 - r] for r in range(p)]
        local = [a for acts in s.ranks for a in acts if a.kind in schedules.COMM and schedules.is_local(a, s)]
        assert {(a.kind, a.stage) for a in local} == {
            ("SEND_F", p - 1), ("RECV_F", p), ("SEND_B", p), ("RECV_B", p - 1)}
        assert len(local) == 4 * m
        t = schedules.simulate(s)
        assert t.idle == [p - 1] * p and t.makespan == 6 * m + p - 1
    assert schedules.peak_live_rank(schedules.build("zb-v", p, m, 2)) == [2 * p] * p
    assert schedules.peak_live_rank(schedules.build("dualpipe-v", p, m, 2)) == [2 * p + 1] * p
    assert schedules.peak_live_rank(schedules.build("zb-v", 4, 4, 2)) == [5, 6, 7, 8]
    with pytest.raises(schedules.ScheduleError, match="dualpipe-v needs micro-batches"):
        schedules.build("dualpipe-v", 4, 7, 2)


def test_v_schedules_match_the_ledger_bubble():
    from fived.ledger.bubble import bubble_fraction

    for name in schedules.V_SHAPED:
        for p, m in ((2, 4), (4, 8), (4, 16), (8, 16)):
            par = ParallelConfig(pp=p, micro_batches=m, schedule=name, virtual_stages=2)
            t = schedules.simulate(schedules.build(name, p, m, 2))
            assert bubble_fraction(par) == pytest.approx(t.bubble_fraction(), abs=1e-12)
    for m in range(1, 8):
        par = ParallelConfig(pp=4, micro_batches=m, schedule="zb-v", virtual_stages=2)
        t = schedules.simulate(schedules.build("zb-v", 4, m, 2))
        assert bubble_fraction(par) == pytest.approx(t.bubble_fraction(), abs=1e-12), m


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_peak_live_micro_batches(p, m):
    assert max(schedules.peak_live_rank(schedules.build("1f1b", p, m))) == p
    assert schedules.peak_live_rank(schedules.build("1f1b", p, m)) == [p - r for r in range(p)]
    assert schedules.peak_live_rank(schedules.build("gpipe", p, m)) == [m] * p
    assert max(schedules.peak_live_rank(schedules.build("zb-h1", p, m))) <= p


def _broken(name="1f1b", p=4, m=8):
    return schedules.build(name, p, m, _v(name))


def test_checker_names_a_forward_before_its_receive():
    s = _broken()
    acts = s.ranks[1]
    i = acts.index(schedules.Action("RECV_F", 0, 1))
    acts[i], acts[i + 1] = acts[i + 1], acts[i]
    with pytest.raises(schedules.ScheduleError, match=r"rank 1 action 0 F\(mb=0, stage=1\) needs "
                                              r"RECV_F\(mb=0, stage=1\) \(input activation"):
        schedules.check(s)


def test_checker_names_a_backward_before_its_forward():
    s = _broken("gpipe", 2, 2)
    s.ranks[0].remove(schedules.Action("F", 1, 0))
    s.ranks[0].append(schedules.Action("F", 1, 0))
    with pytest.raises(schedules.ScheduleError, match=r"SEND_F\(mb=1, stage=0\) needs F\(mb=1, stage=0\)"):
        schedules.check(s)


def test_checker_rejects_an_unmatched_send_and_a_missing_action():
    s = _broken("gpipe", 2, 2)
    s.ranks[1].remove(schedules.Action("RECV_F", 1, 1))
    s.ranks[1].remove(schedules.Action("F", 1, 1))
    with pytest.raises(schedules.ScheduleError, match=r"rank 1 action \d+ B\(mb=1, stage=1\) needs "
                                              r"F\(mb=1, stage=1\)"):
        schedules.check(s)
    s = _broken("zb-h1", 2, 2)
    s.ranks[0] = [a for a in s.ranks[0] if a != schedules.Action("W", 1, 0)]
    with pytest.raises(schedules.ScheduleError, match=r"rank 0 never runs W\(mb=1, stage=0\)"):
        schedules.check(s)


def test_checker_finds_a_deadlock():
    # rank 0 waits for the gradient of mb 0 before it sends mb 1's activation, rank 1 (GPipe)
    # runs both forwards before any backward: every dependency is local-consistent, but stuck
    s = schedules.build("gpipe", 2, 2)
    r0 = [schedules.Action("F", 0, 0), schedules.Action("SEND_F", 0, 0), schedules.Action("F", 1, 0),
          schedules.Action("RECV_B", 0, 0), schedules.Action("SEND_F", 1, 0), schedules.Action("B", 0, 0),
          schedules.Action("RECV_B", 1, 0), schedules.Action("B", 1, 0)]
    s.ranks[0] = r0
    with pytest.raises(schedules.ScheduleError, match=r"deadlock: rank 0 action 3 RECV_B\(mb=0, "
                                              r"stage=0\) waits for the gradient of stage 1"):
        schedules.check(s)


def test_executor_refuses_a_broken_schedule_before_running():
    from fived.parallel.pipeline.runtime import PipelineExecutor

    s = _broken("1f1b", 2, 2)
    s.ranks[1].reverse()
    with pytest.raises(schedules.ScheduleError):
        PipelineExecutor(preset("tiny"), ParallelConfig(pp=2, micro_batches=2), _FakeGrid(),
                         None, torch.float32, sched=s)


class _FakeGrid:
    degrees = {"pp": 2, "dp": 1, "ep": 1, "cp": 1, "tp": 1}

    def coords(self):
        return {"pp": 0, "dp": 0, "ep": 0, "cp": 0, "tp": 0}

    def __getitem__(self, name):
        return None


# ---------------------------------------------------------------- partition

def test_balanced_split_accounts_for_the_head():
    tiny = preset("tiny")
    assert balanced_split(tiny, 2) == [2, 2]
    assert balanced_split(tiny, 4) == [1, 1, 1, 1]
    big_vocab = replace(preset("small"), vocab=32768)  # the head costs ~2.6 layers
    split = balanced_split(big_vocab, 2)
    assert sum(split) == 8 and split[0] > split[1]
    assert balanced_split(preset("llama3-8b"), 4)[-1] < 8


def test_pp_layers_by_hand():
    par = ParallelConfig(pp=2, pp_layers=(3, 1))
    assert partition(preset("tiny"), par) == [[0, 1, 2], [3]]
    with pytest.raises(ConfigError):
        partition(preset("tiny"), ParallelConfig(pp=2, pp_layers=(3, 3)))


@pytest.mark.parametrize("pp,v,layers,schedule", [
    (2, 1, (), "1f1b"), (4, 1, (), "1f1b"), (2, 2, (), "interleaved"), (2, 1, (3, 1), "1f1b"),
    (2, 2, (), "zb-v"), (2, 2, (), "dualpipe-v")])
def test_any_split_builds_the_same_model(pp, v, layers, schedule):
    """Each pipeline rank's stage (its chunks of the plain model, as ``parallelize`` cuts them)
    holds its layers under their global names with the one-rank weights and whole placements;
    the ranks together hold every parameter exactly once."""
    cfg = preset("tiny")
    ref = dict(build_model(cfg, 7).named_parameters())
    par = ParallelConfig(pp=pp, virtual_stages=v, schedule=schedule, pp_layers=layers)
    stages = partition(cfg, par)
    seen = {}
    for r in range(pp):
        chunks, placements = parallelize_parts(build_model(cfg, 7), offline_grid(par, r), par)
        ids = stage_ids(par, r)
        assert [c.layer_ids for c in chunks] == [stages[s] for s in ids]
        assert [(c.first, c.last) for c in chunks] == [(s == 0, s == pp * v - 1) for s in ids]
        stage = StageModel(chunks, ids)
        named = dict(stage.named_parameters())
        assert sorted(named) == sorted(placements)
        for n, p in named.items():
            assert n not in seen, n
            assert placements[n] == placements[n].__class__(n, tuple(ref[n].shape)), n
            seen[n] = p
    assert sorted(seen) == sorted(ref)
    for n, p in ref.items():
        assert torch.equal(seen[n], p), n


def test_tied_embeddings_are_split_with_the_embedding_on_both_ends():
    """Tied embeddings under pp (Megatron's embedding group): the first and the last stage both
    hold ``embed_tokens.weight``, the last one's head reads it; the parts between hold none
    (tests/test_mtp.py trains it equal to one rank)."""
    from fived.config import validate
    from fived.model import build_model
    from fived.parallel.pipeline.stage import split

    cfg = replace(preset("tiny"), tied_embeddings=True)
    par = ParallelConfig(pp=4, micro_batches=4)
    validate(cfg, par)
    model = build_model(cfg, 0)
    for r, want in enumerate((True, False, False, True)):
        (part,), _ = split(model, par, r)
        names = [n for n, _ in part.named_parameters()]
        assert ("embed_tokens.weight" in names) == want, (r, names)
        assert "lm_head.weight" not in names
    (last,), _ = split(model, par, 3)
    assert last.lm_head.embedding is last.embed_tokens is model.embed_tokens
