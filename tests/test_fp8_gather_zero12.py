"""ZeRO-1/2's fp8 parameter all-gather (``fived.parallel.data.zero12``, ``fp8.Fp8Gather``): the
fp8 linears' weights kept as the owned compute-dtype shard and the whole e4m3 cast with its
scales (the compute-dtype buffer freed), gathered in e4m3 after every step; the layout equals
the one-rank fp8 run of the same recipe; the traffic and the model states against the ledger.

Mutations seen to fail (each restored): the amax all-reduce over the shard group removed
(``test_zero12_fp8_gather_equals_one_rank_and_the_ledger[1-tensorwise]``: losses 5.4e-2
apart); the compute-dtype buffer of the fp8 buckets kept instead of freed (``test_zero1_fp8_
gather_frees_bf16...``: 2,580,480 bytes behind the fp8 weights at every step's start, not 0);
the scales not taken again after a step (``stale`` skipped: the losses stay equal over 3 steps —
power-of-2 scales rarely move —, the traffic check fails, 56 B of amax all-reduce missing per
step); the ledger's fp8 split of the ZeRO-1/2 buckets removed (the traffic check: the gather
counted at 4 bytes); the provided casts not withdrawn when the engine closes (the next run in
the same process finds a stale cast under a reused parameter id and fails); the peak's
``fp8_gather`` transient left out (``tests/test_peak.py``'s dp4 ZeRO-1 row: the optimizer phase
3.4 % under the traced one).
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
    for h in out["ranks"][0]["history"]:  # every rank's bytes of every step
        for got, mem in zip(h["traffic_per_rank"], h["memory_per_rank"]):
            assert got["bytes"] == pytest.approx(want, rel=1e-12, abs=0), h
            assert {k: mem[k] for k in states if k != "buffers"} == {
                k: v for k, v in states.items() if k != "buffers"}, (mem, states)
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
        self.masters: dict[str, list[float]] = {}

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
            self.masters = {n: v.flatten().tolist()[:64] + [float(v.double().sum())]
                            for n, v in trainer.engine.full_params().items()}


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
                    "traffic": s["history"][-1]["traffic"],
                    "storage": probe.storage, "provided": probe.provided,
                    "forward": probe.forward, "masters": probe.masters})
    return out


def test_zero1_fp8_gather_frees_bf16_resumes_both_ways_and_skips_a_bad_step(tmp_path):
    """bf16 dp2 ZeRO-1 tensorwise, with the fp8 gather against --no-fp8-gather: the fp8
    weights' compute-dtype storage is freed (0 bytes at every step's start; 4 KiB+ without the
    gather) and every one of them is provided cast; the losses equal bit for bit (the gathered
    cast is the cast the linear makes of the whole weight); a checkpoint saved with the gather
    resumes bit-exactly with it and without it, and one saved without it resumes with it; the
    forward-only loss (evaluation's pass) and ``full_params`` (the masters, whole) are the
    same; a NaN planted on rank 1 at step 2 skips that step alike under both (the casts stay
    those of step 1's update). The counted bytes of a step equal the ledger's with and without
    the gather, and the fp8 buckets' all-gather is half the bf16 one (the same padded buckets, 1
    byte per element against 2)."""
    from fived.ledger.traffic import step_bytes, step_traffic
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
    assert full["masters"] == ref["masters"] and len(full["masters"]) == len(ref["masters"]) > 0
    for first in (first_on, first_off):
        assert first["losses"] == full["losses"][:3]
    for rest in (on_on, on_off, off_on):
        assert rest["losses"] == full["losses"][3:], (rest["losses"], full["losses"])
    assert on_on["storage"] == [0, 0] and all(on_on["provided"])
    assert bad_on["skipped"] == [False, False, True, False, False]
    assert bad_on["losses"] == bad_off["losses"] and bad_on["skipped"] == bad_off["skipped"]
    assert bad_on["losses"][3] != full["losses"][3]
    micro = t.global_batch // 2
    assert full["traffic"] == step_bytes(TINY, on, micro), full["traffic"]
    assert ref["traffic"] == step_bytes(TINY, off, micro), ref["traffic"]
    fp8_gathers = [[c.bytes for c in step_traffic(TINY, p, micro) if c.op == "all_gather"]
                   for p in (on, off)]
    # on: [the fp8 bucket's, the rest's]; off: [the whole bucket's]
    assert len(fp8_gathers[0]) == 2 and len(fp8_gathers[1]) == 1, fp8_gathers
    rest = fp8_gathers[0][1]
    assert fp8_gathers[0][0] == pytest.approx(0.5 * (fp8_gathers[1][0] - rest), rel=1e-3)


MOE = replace(preset("tiny-moe"), layers=2, seq_len=16)
HARDER = [  # (model, layout): the shard group under hybrid sharding, tp, pp, the expert group
    (TINY, ParallelConfig(dp=4, dp_shard=2, zero=1, precision="fp32", fp8="tensorwise")),
    (TINY, ParallelConfig(tp=2, dp=2, zero=2, precision="fp32", fp8="tensorwise",
                          sequence_parallel=True)),
    (TINY, ParallelConfig(pp=2, dp=2, zero=1, precision="fp32", fp8="blockwise",
                          micro_batches=2)),
    (MOE, ParallelConfig(ep=2, dp=2, zero=1, precision="fp32", fp8="tensorwise")),
]


@pytest.mark.slow
def test_zero12_fp8_gather_hybrid_tp_pp_equal_one_rank_and_the_ledger():
    """Hybrid sharding dp4 = 2 shards × 2 replicas (the amax and the gather over the shard
    group, which holds the whole bucket), tp2+SP·dp2 ZeRO-2 (the amax reduced over tp too) and
    pp2·dp2 ZeRO-1 blockwise (m = 2) and a MoE model at ep2·dp2 ZeRO-1 (the experts' fp8
    buckets gathered over the expert group) against the one-rank fp8 run; every rank's traffic
    (the ep all-to-all aside: it follows the router) and model states equal the ledger's."""
    from fived.ledger.memory import model_states
    from fived.ledger.traffic import step_bytes
    from fived.ledger.verify import coords

    train = replace(TRAIN, global_batch=8)
    outs = train_runs([(m, p, train) for m, p in HARDER])
    for (m, par), out in zip(HARDER, outs):
        micro = train.global_batch // (par.dp * par.ep) // par.micro_batches
        check_parity(out, fp8_reference(m, par.fp8, train.global_batch // micro, train),
                     par.describe())
        h = out["ranks"][0]["history"][-1]  # every rank's record of the step
        for rank in range(par.world_size):
            pp_rank = coords(par, rank)["pp"]
            got = h["traffic_per_rank"][rank]["bytes"]
            want = step_bytes(m, par, micro, pp_rank)
            if m.is_moe:  # the ep all-to-all follows the router (test_expert's check)
                got, want = ({k: v for k, v in d.items() if k != "ep"} for d in (got, want))
            assert got == pytest.approx(want, rel=1e-12), (par.describe(), rank, got)
            states = model_states(m, par, pp_rank)
            mem = h["memory_per_rank"][rank]
            assert {k: mem[k] for k in ("params", "grads", "padding")} == {
                k: states[k] for k in ("params", "grads", "padding")}, (par.describe(), rank)


SLOW = pytest.mark.slow
DRY = [pytest.param("tiny", "--dp 2 --zero 1", "tensorwise", marks=SLOW),
       ("tiny", "--dp 4 --dp-shard 2 --zero 2", "tensorwise"),  # the default suite's
       pytest.param("tiny", "--tp 2 --dp 2 --zero 1 --sequence-parallel", "tensorwise",
                    marks=SLOW),
       pytest.param("tiny", "--pp 2 --dp 2 --zero 1 --micro-batches 2", "tensorwise",
                    marks=SLOW),
       pytest.param("tiny", "--dp 2 --zero 2", "blockwise", marks=SLOW),
       pytest.param("tiny-moe", "--ep 2 --dp 2 --zero 1", "tensorwise", marks=SLOW)]


@pytest.mark.parametrize("model,layout,recipe", DRY)
def test_dry_run_of_the_zero12_fp8_gather_is_exact(tmp_path, model, layout, recipe):
    """`fived train --dry-run --zero 1|2 --fp8 R`, then `fived ledger --check`: every rank's
    traffic and model states (storage bytes: the shard, the e4m3 cast, the scales) exact."""
    from parity_helpers import dry_run_is_exact

    dry_run_is_exact(tmp_path, "--model", model, "--fp8", recipe, "--precision", "bf16",
                     *layout.split())


def test_plan_prices_the_zero12_fp8_gather():
    """`fived plan --fp8 tensorwise` keeps the recipe and the gather in every layout it
    searches: its dp4 ZeRO-1 layout of `small` holds the ledger's parameter bytes with the fp8
    gather, less than with `--no-fp8-gather` (which the plan keeps too); the winner's `fived
    ledger` command carries both flags."""
    import json

    from parity_helpers import run_cli

    from fived.ledger.memory import model_states

    got = {}
    for extra in ((), ("--no-fp8-gather",)):
        r = run_cli("plan", "--model", "small", "--gpus", "4", "--zero", "1", "--fp8",
                    "tensorwise", "--precision", "bf16", "--schedules", "1f1b", "--json",
                    "--top", "100", *extra)
        assert r.returncode == 0, r.stderr
        top = json.loads(r.stdout)["top"]
        flat = [t for t in top if t["layout"].startswith("dp4·zero1·b4")
                and t["parallel"]["recompute"] == "none"]
        assert flat, [t["layout"] for t in top]
        got[bool(extra)] = flat[0]["memory"]["states"]["params"]
    m = preset("small")
    on = ParallelConfig(dp=4, zero=1, precision="bf16", fp8="tensorwise")
    assert got[False] == model_states(m, on)["params"]
    assert got[True] == model_states(m, replace(on, fp8_gather=False))["params"] > got[False]
    r = run_cli("plan", "--model", "small", "--gpus", "4", "--zero", "1", "--fp8", "tensorwise",
                "--no-fp8-gather", "--precision", "bf16", "--top", "1")
    assert "--fp8 tensorwise --no-fp8-gather" in " ".join(r.stdout.replace("\\", "").split())
