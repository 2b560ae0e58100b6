"""`--gpu this-machine`'s traced kernels (fived.probe.kernels) and how the clock uses them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fived.config import ModelConfig, ParallelConfig
from fived.ledger import hardware, roofline
from fived.probe import kernels
from fived.probe.machine import time_sharing

TINY = ModelConfig(name="tiny-probe", vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64,
                   seq_len=16)
PAR = ParallelConfig()


def _per_block(tr, phase, kind):
    one, two = tr[phase + "1"], tr[phase + "2"]
    return sum(n - one.get(k, 0) for k, n in two.items() if kernels._kind(k[0]) == kind)


def test_trace_finds_one_blocks_gemms_and_its_attention():
    tr = kernels.trace(TINY, PAR, 2)
    # q, k, v, o, gate, up, down: 7 GEMMs forward, their dX and dW backward
    assert _per_block(tr, "fwd", "gemm") == 7
    assert _per_block(tr, "bwd", "gemm") == 14
    assert _per_block(tr, "fwd", "attn") == 1 and _per_block(tr, "bwd", "attn") == 1
    assert _per_block(tr, "fwd", "ew") > 10  # norms, RoPE, SiLU·mul, residuals
    # the head is the one GEMM outside the blocks, in the forward
    stage = sum(n - 2 * (n - tr["fwd1"].get(k, 0)) for k, n in tr["fwd2"].items()
                if kernels._kind(k[0]) == "gemm")
    assert stage == 1


def test_every_traced_op_is_timed():
    out = kernels.measure(TINY, PAR, 2, seconds=0.002)
    assert out["untimed"] == 0
    e = kernels.as_tuple(out)
    assert len(e) == 8 and all(t > 0 for t in e)
    assert out["kernels"] > 21


def test_a_tp_rank_is_traced_as_a_block_cut_tp_ways_and_cp_is_not_traced():
    assert kernels.traceable(TINY, PAR) and kernels.traceable(TINY, ParallelConfig(tp=2))
    assert not kernels.traceable(TINY, ParallelConfig(cp=2))
    assert not kernels.traceable(TINY, ParallelConfig(ep=2))
    cut = kernels.local_model(TINY, ParallelConfig(tp=4))
    assert (cut.heads, cut.kv_heads, cut.ffn, cut.vocab, cut.hidden) == (1, 1, 16, 16, 32)
    tr = kernels.trace(TINY, ParallelConfig(tp=2), 2)
    assert _per_block(tr, "fwd", "gemm") == 7


def test_the_clock_takes_the_measured_kernels_in_place_of_attention_and_bytes():
    hw = replace(hardware.PRESETS["h100-sxm"], overhead=0.0)
    eager = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0)
    opts = roofline.ClockOptions(attention="materialised", fused=False, comm_overlap=False)
    plain = roofline.micro_batch_times(TINY, PAR, 2, hw, 2, True, True, opts)
    got = roofline.micro_batch_times(TINY, PAR, 2, replace(hw, eager=eager), 2, True, True, opts)
    blk = roofline.block_ops(TINY, PAR, 2, opts)
    ext = roofline.stage_extra_ops(TINY, PAR, 2, True, True, opts)

    def gemms(ops):
        return sum(roofline.op_seconds(o, hw, "fp32") for o in ops
                   if o.kind == "gemm" and not o.name.startswith("attn."))

    assert got["fwd"] == pytest.approx(2 * (gemms(blk["fwd"]) + 1.0 + 3.0) + 5.0 + 7.0
                                       + gemms(ext["fwd"]))
    assert got["bwd"] == pytest.approx(2 * (gemms(blk["bwd"]) + 2.0 + 4.0) + 6.0 + 8.0
                                       + gemms(ext["bwd"]))
    assert got["memory_bound"] == pytest.approx(2 * (3.0 + 4.0))
    assert got["attn_core"] == pytest.approx(2 * 1.0)
    assert plain["fwd"] < 1.0  # without them: the roofline's own count
    middle = roofline.micro_batch_times(TINY, PAR, 2, replace(hw, eager=eager), 2, False, False, opts)
    assert middle["fwd"] == pytest.approx(2 * (gemms(blk["fwd"]) + 1.0 + 3.0))


@pytest.mark.parametrize("ranks,threads,cores,want", [
    (1, 2, 2, (1, 1)), (2, 1, 2, (2, 2)), (4, 1, 2, (2, 2)), (3, 1, 2, (2, 2)),
    (8, 2, 16, (8, 8))])
def test_probes_run_as_many_processes_as_the_cores_hold(ranks, threads, cores, want):
    assert time_sharing(ranks, threads, cores) == want


def test_time_shared_ranks_are_bounded_by_their_busy_time_over_the_cores():
    from fived.config import PRESETS
    from fived.ledger import planner

    m = PRESETS["small"]
    hw = replace(hardware.PRESETS["h100-sxm"], cores=2, step_overhead=0.0)
    dp4 = planner.predict(m, ParallelConfig(dp=4), hw, 16)
    free = planner.predict(m, ParallelConfig(dp=4), replace(hw, cores=0), 16)
    busy = free.step_seconds - free.times["dp"]  # one rank's compute and optimizer
    # four ranks each busy `busy`, two at a time, then the all-reduce they wait on together
    assert dp4.step_seconds == pytest.approx(2 * busy + free.times["dp"])
    assert dp4.times["time_shared"] == pytest.approx(dp4.step_seconds - free.step_seconds)
    # a pipeline's idle ranks leave the cores to the busy ones: one micro-batch on pp2·dp2
    # keeps two of four ranks busy at a time, so sharing costs (almost) nothing
    pp = planner.predict(m, ParallelConfig(dp=2, pp=2), hw, 16)
    pp_free = planner.predict(m, ParallelConfig(dp=2, pp=2), replace(hw, cores=0), 16)
    assert pp.step_seconds < 1.1 * pp_free.step_seconds
    assert planner.predict(m, ParallelConfig(dp=2), hw, 16).times["time_shared"] == 0.0


@pytest.mark.slow
def test_ledger_this_machine_carries_the_traced_kernels():
    """In this process (the subject is the command's JSON, not the interpreter); the probe's
    ranks come from the suite's pool."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from parity_helpers import run_cli

    r = run_cli("ledger", "--model", "tiny", "--gpu", "this-machine", "--gpus", "2", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(doc["hardware"]["eager"]) == 8 and all(t > 0 for t in doc["hardware"]["eager"])
    assert "eager kernels traced and timed" in doc["hardware"]["note"]
    assert doc["time"]["step_seconds"] > 0
