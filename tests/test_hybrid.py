"""Hybrid sharding (``--dp-shard N --dp-replicate M``, issue 42): ZeRO inside a shard group of N
dp ranks, the shard's reduced gradient all-reduced across the M replicas.

* the layout: the grid's sub-dimensions and groups, exactly which ranks each holds (with ep,
  cp, tp); ``--dp`` alone keeps today's groups; ``fived grid`` shows them and warns when a
  shard group crosses a node; bad input exits 2 naming the flag, before any rank starts;
* parity (losses and every parameter's gathered first-step gradient, 1e-5, ``check_parity``)
  with one rank at dp-shard 2 × dp-replicate 2 for ZeRO 1/2/3, with tp2, pp2 (both
  ``--zero3-pp-gather`` modes), ep2 (tiny-moe) and cp2; and on every rank of every step the
  ledger's model-state bytes and bytes per group equal the engine's (what ``fived ledger
  --check`` runs), including the replicate group's all-reduce;
* checkpoints: a hybrid run resumes bit for bit; flat dp8 ZeRO-3 ↔ 4 × 2 reshard, the first
  resumed loss bit-identical to the straight run's (the same parameters, loaded exactly);
* the ledger's states ÷ N (× dp/N against flat ZeRO) and the planner's shard degrees.

Mutation (seen to fail once, then restored): ``Replicated.advance`` in
``fived/parallel/data/zero12.py`` with its all-reduce removed (``self.ar = self.rs``) fails
``test_hybrid_parity_zero123``: "replicas of lm_head.weight differ" (each replica holds only its
own replica's sum, so the gathered gradients disagree between replicas and are not the
one-rank gradient).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest

from fived.config import ConfigError, ParallelConfig, fill_dp, preset, validate
from fived.ledger import memory, planner, verify
from fived.ranks.grid import Grid
from fived.testing import rel_diff, run_ranks, small_train

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import check_parity, cli_exits_2, one_rank, run_cli, train_runs  # noqa: E402

MODEL, MOE = preset("tiny"), preset("tiny-moe")
TRAIN = small_train()


# ------------------------------------------------------------------ the layout (no ranks)
def test_grid_groups_hold_exactly_these_ranks():
    """dp 4 = 2 shard × 2 replicate, shard inside replicate: a shard group is contiguous."""
    g = Grid.from_config(ParallelConfig(dp=4, dp_shard=2, zero=3))
    assert g.hybrid and g.sub_degrees() == {"dp_shard": 2, "dp_replicate": 2}
    assert g.partition(Grid.named_dims("dense_shard")) == [(0, 1), (2, 3)]
    assert g.partition(Grid.named_dims("dp_replicate")) == [(0, 2), (1, 3)]
    assert g.shard_group("dense") == "dense_shard" and g.shard_group("expert") == "expert_shard"
    # with ep2 (experts) and tp2 (innermost): rank = dp·4 + ep·2 + tp
    g = Grid.from_config(ParallelConfig(dp=4, dp_shard=2, ep=2, tp=2, zero=1))
    assert g.members_of("dense_shard", 0) == (0, 2, 4, 6)   # dp_shard × ep, tp 0
    assert g.members_of("expert_shard", 0) == (0, 4)        # dp_shard only, ep 0
    assert g.members_of("dp_replicate", 0) == (0, 8)        # across the two replicas
    assert g.members_of("dp_replicate", 7) == (7, 15)
    assert g.members_of("dense", 0) == (0, 2, 4, 6, 8, 10, 12, 14)  # unchanged
    # with cp2: the shard group is dp_shard·cp
    g = Grid.from_config(ParallelConfig(dp=4, dp_shard=2, cp=2, zero=2))
    assert g.members_of("dense_shard", 0) == (0, 1, 2, 3)
    assert g.members_of("dp_replicate", 1) == (1, 5)


def test_dp_alone_is_todays_layout():
    for par in (ParallelConfig(dp=4, zero=3), ParallelConfig(dp=4, dp_shard=4, zero=3),
                ParallelConfig(dp=2, ep=2, tp=2, zero=1)):
        g = Grid.from_config(par)
        assert not g.hybrid and g.shard_group("dense") == "dense"
        assert g.partition(Grid.named_dims("dp_replicate")) == [(r,) for r in
                                                                 range(par.world_size)]
        assert g.partition(Grid.named_dims("dense_shard")) == g.partition(
            Grid.named_dims("dense"))
    assert ParallelConfig(dp=8).describe() == "dp8"
    assert ParallelConfig(dp=8, dp_shard=4, zero=3).describe() == "dp8(4s×2r)·zero3"


def test_fill_dp_and_validation():
    par, world = fill_dp(ParallelConfig(dp_shard=4, dp_replicate=2, zero=3), False)
    assert (par.dp, world, par.shard_degree, par.replicate_degree) == (8, 8, 4, 2)
    par, world = fill_dp(ParallelConfig(dp_shard=2, zero=1, tp=2), False, 8)
    assert (par.dp, par.replicate_degree) == (4, 2)
    validate(MODEL, par, TRAIN, 8)
    bad = {"--dp-shard 3": ParallelConfig(dp=4, dp_shard=3, zero=3),
           "--dp-replicate 3": ParallelConfig(dp=4, dp_replicate=3, zero=3),
           "--zero 0": ParallelConfig(dp=4, dp_shard=2),
           "--order pp,tp,dp,ep,cp": ParallelConfig(dp=4, dp_shard=2, tp=2, zero=1,
                                                    order=("pp", "tp", "dp", "ep", "cp"))}
    for words, p in bad.items():
        with pytest.raises(ConfigError, match=words.split()[0]) as e:
            validate(MODEL, p, TRAIN, p.world_size)
        assert words in str(e.value) and "valid" in str(e.value)


@pytest.mark.parametrize("argv,field", [
    (["--dp", "4", "--dp-shard", "3", "--zero", "3"], "--dp-shard 3: must divide dp = 4"),
    (["--dp-shard", "2", "--dp-replicate", "3", "--dp", "4", "--zero", "1"], "--dp-replicate"),
    (["--dp", "4", "--dp-shard", "2"], "--zero 0"),
    (["--dp", "4", "--tp", "2", "--dp-shard", "2", "--zero", "1", "--order", "pp,tp,dp,ep,cp"],
     "split tp groups"),
])
def test_bad_input_exits_2_before_any_rank(argv, field):
    msg = cli_exits_2(["train", "--steps", "1", *argv], field)
    assert "valid" in msg


def test_fived_grid_shows_the_groups_and_warns_across_nodes():
    r = run_cli("grid", "--dp-shard", "4", "--dp-replicate", "2", "--gpus-per-node", "4")
    assert r.returncode == 0, r.stderr
    assert "dp_shard" in r.stdout and "dp_replicate" in r.stdout and "0,1,2,3" in r.stdout
    assert "crosses a node" not in r.stdout  # 4 contiguous ranks on a 4-GPU node
    r = run_cli("grid", "--dp-shard", "4", "--dp-replicate", "2", "--gpus-per-node", "2")
    assert "WARNING: a ZeRO shard group (dense_shard) crosses a node" in " ".join(
        r.stdout.split())
    r = run_cli("grid", "--dp", "4", "--dp-shard", "3")
    assert r.returncode == 2 and "--dp-shard 3" in r.stderr
    flat = run_cli("grid", "--dp", "4", "--gpus-per-node", "2")
    assert "dp_shard" not in flat.stdout and "dense_shard" not in flat.stdout


# ------------------------------------------------------------------ the ledger and the planner
def test_ledger_states_divide_by_the_shard_degree():
    """Model-state bytes per rank of hybrid ZeRO = flat ZeRO's × dp/N (no padding: tiny's
    buckets split evenly), for every stage; the replicate all-reduce is the shard's bytes."""
    for zero in (1, 2, 3):
        flat = memory.model_states(MODEL, ParallelConfig(dp=8, zero=zero))
        hyb = memory.model_states(MODEL, ParallelConfig(dp=8, dp_shard=2, zero=zero))
        sharded = {1: ("optimizer",), 2: ("grads", "optimizer"),
                   3: ("params", "grads", "optimizer")}[zero]
        for k in sharded:
            assert hyb[k] == 4 * flat[k], (zero, k, hyb[k], flat[k])
    from fived.ledger.traffic import step_bytes

    t = step_bytes(MODEL, ParallelConfig(dp=8, dp_shard=2, zero=3), 1)
    assert set(t) == {"dense_shard", "dp_replicate"}
    shard = memory.model_states(MODEL, ParallelConfig(dp=8, dp_shard=2, zero=3))["grads"]
    assert t["dp_replicate"] == 2 * (4 - 1) / 4 * shard  # ring all-reduce of the shard


def test_planner_prices_each_group_on_its_link_and_tries_shard_degrees():
    par = ParallelConfig(dp=16, dp_shard=8, zero=3)
    assert planner.inside_node(par, "dense_shard", 8)
    assert not planner.inside_node(par, "dp_replicate", 8)
    assert not planner.inside_node(ParallelConfig(dp=16, zero=3), "dense", 8)
    assert planner.shard_degrees(64, 2, 8, 3) == [0, 4, 8]
    assert planner.shard_degrees(64, 2, 8, 3, ep_cp=2) == [0, 1, 4, 8]
    assert planner.shard_degrees(64, 2, 8, 0) == [0]


# ------------------------------------------------------------------ parity and the ledger check
HYBRID = [
    ParallelConfig(dp=4, dp_shard=2, zero=1, micro_batches=2, bucket_mb=0.05),
    ParallelConfig(dp=4, dp_shard=2, zero=2, bucket_mb=0.05),
    ParallelConfig(dp=4, dp_shard=2, zero=3),
    ParallelConfig(dp=4, dp_shard=2, zero=2, collectives="ring"),  # fived's ring, both halves
]


def _check_ledger(model, par, out) -> None:
    for rec in out["ranks"][0]["history"]:
        assert verify.compare_record(model, par, TRAIN.global_batch, rec) == [], (
            par.describe(), rec["step"])
    got = out["ranks"][0]["history"][0]["traffic_per_rank"]
    assert all(r["bytes"].get("dp_replicate", 0) > 0 for r in got), got


def test_hybrid_parity_zero123():
    """dp-shard 2 × dp-replicate 2, ZeRO 1 (2 micro-batches), 2 (small buckets: several
    all-reduces in flight), 3, and ZeRO-2 on fived's ring (``--collectives ring``): parity with
    one rank, and the ledger exact on every rank.
    Time: the one-rank reference (shared with the other modules) and one 4-rank spawn."""
    ref = one_rank(MODEL, TRAIN)
    for par, out in zip(HYBRID, train_runs([(MODEL, p, TRAIN) for p in HYBRID])):
        check_parity(out, ref, par.describe())
        _check_ledger(MODEL, par, out)


WITH = {  # one fast layout per combination (8 ranks: 2 × 2 × the other degree)
    "tp2-zero3": (MODEL, ParallelConfig(dp=4, dp_shard=2, tp=2, zero=3)),
    "pp2-zero3-step": (MODEL, ParallelConfig(dp=4, dp_shard=2, pp=2, zero=3, micro_batches=2)),
    "pp2-zero3-micro": (MODEL, ParallelConfig(dp=4, dp_shard=2, pp=2, zero=3, micro_batches=2,
                                              zero3_pp_gather="micro")),
    "ep2-zero2": (MOE, ParallelConfig(dp=4, dp_shard=2, ep=2, zero=2)),
    "cp2-zero1": (MODEL, ParallelConfig(dp=4, dp_shard=2, cp=2, zero=1)),
}


def _with(names: list[str]) -> None:
    pairs = [WITH[n] for n in names]
    for (m, par), out, name in zip(pairs, train_runs([(m, p, TRAIN) for m, p in pairs]), names):
        check_parity(out, one_rank(m, TRAIN), name)
        _check_ledger(m, par, out)


def test_hybrid_with_tp_pp_ep_cp():
    """Time: 8 ranks (2 × 2 × tp2/pp2/ep2/cp2) train five layouts in one spawn on 2 cores."""
    _with(list(WITH))


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hybrid_matrix(zero):
    """Every ZeRO stage with tp2, pp2 (both gather modes for ZeRO-3), ep2, cp2."""
    pairs = []
    for m, par in WITH.values():
        if par.zero3_pp_gather == "micro" and zero != 3:
            continue
        pairs.append((m, replace(par, zero=zero)))
    for (m, par), out in zip(pairs, train_runs([(m, p, TRAIN) for m, p in pairs])):
        check_parity(out, one_rank(m, TRAIN), par.describe())
        _check_ledger(m, par, out)


# ------------------------------------------------------------------ checkpoints
K = 3


def _losses(rank: int, world: int, runs: list) -> list[list[float]]:
    from fived.train.trainer import train_rank

    return [train_rank(rank, world, m, p, t, show=False)["losses"] for m, p, t in runs]


@pytest.mark.parametrize("dp,shard", [(4, 2), pytest.param(8, 4, marks=pytest.mark.slow)],
                         ids=["dp4-2x2", "dp8-4x2"])
def test_hybrid_checkpoint_resume_bit_exact_and_reshard_with_flat(tmp_path, dp, shard):
    """Time: two spawns of dp ranks. Flat ZeRO-3 and shard × replicate each save after K
    steps; the hybrid run resumes its own checkpoint bit for bit; each resumes the other's:
    the first resumed loss equals the straight run's exactly (the same parameters, loaded
    exactly), the rest within 1e-5 (the reduction order differs). dp4 (2 × 2) in the default
    suite, the issue's dp8 (4 × 2) under ``-m slow``."""
    flat = ParallelConfig(dp=dp, zero=3)
    hyb = ParallelConfig(dp=dp, dp_shard=shard, zero=3)
    stop = {n: replace(TRAIN, stop_after=K, save_dir=str(tmp_path / n)) for n in ("f", "h")}
    straight_f, _, straight_h, _ = run_ranks(
        _losses, dp, [(MODEL, flat, TRAIN), (MODEL, flat, stop["f"]), (MODEL, hyb, TRAIN),
                      (MODEL, hyb, stop["h"])], timeout=900)[0]
    resumed = run_ranks(_losses, dp, [
        (MODEL, hyb, replace(TRAIN, resume=str(tmp_path / "h"))),
        (MODEL, hyb, replace(TRAIN, resume=str(tmp_path / "f"))),
        (MODEL, flat, replace(TRAIN, resume=str(tmp_path / "h")))], timeout=900)[0]
    assert resumed[0] == straight_h[K:]  # bit for bit
    for got, ref in ((resumed[1], straight_f), (resumed[2], straight_h)):
        assert got[0] == ref[K], (got, ref)
        assert rel_diff(got, ref[K:]) < 1e-5


def test_hybrid_run_saves_the_same_global_names(tmp_path):
    from fived.checkpoint.state import tensor_table

    stop = [replace(small_train(steps=1), save_dir=str(tmp_path / n)) for n in ("f", "h")]
    run_ranks(_losses, 4, [(MODEL, ParallelConfig(dp=4, zero=3), stop[0]),
                           (MODEL, ParallelConfig(dp=4, dp_shard=2, zero=3), stop[1])],
              timeout=600)
    ckpts = [sorted((tmp_path / n).glob("step-*"))[-1] for n in ("f", "h")]
    a, b = (tensor_table(c) for c in ckpts)
    assert sorted(a) == sorted(b) and a
    assert all(a[k]["shape"] == b[k]["shape"] for k in a)


# ------------------------------------------------------------------ against the peer
def test_bench_zero_hsdp_against_fsdp2_2d_mesh(capsys, monkeypatch):
    """``fived bench zero --hsdp 2`` on 4 ranks (tiny sizes): fived's hybrid ZeRO-3 against
    torch FSDP2 ``fully_shard`` on a (replicate, shard) mesh, the same first loss, the same
    state bytes (both shard over 2), the ratio against FSDP2's HSDP; a bad --hsdp exits 2."""
    from test_bench_schema import TINY, bench_doc

    argv = [*TINY["zero"], "--nprocs", "4", "--global-batch", "4", "--hsdp", "2"]
    doc = bench_doc("zero", capsys, monkeypatch, argv)
    by = {r["implementation"]: r for r in doc["rows"]}
    assert set(by) == {"fived HSDP ZeRO-3 2×2", "fived HSDP ZeRO-3 no-overlap",
                       "fived ZeRO-3 flat", "torch FSDP2 HSDP"}
    assert [r["implementation"] for r in doc["rows"] if r["peer"]] == ["torch FSDP2 HSDP"]
    assert by["fived HSDP ZeRO-3 2×2"]["state_bytes"] == by["torch FSDP2 HSDP"]["state_bytes"]
    assert by["fived HSDP ZeRO-3 2×2"]["state_bytes"] == 2 * by["fived ZeRO-3 flat"][
        "state_bytes"]
    assert len({r["extra"]["first_loss"] for r in doc["rows"]}) == 1
    from fived.bench.zero import main

    with pytest.raises(SystemExit) as e:
        main(["--nprocs", "4", "--hsdp", "3"])
    assert e.value.code == 2
    assert "--hsdp 3" in capsys.readouterr().err


@pytest.mark.parametrize("model,par", [
    ("tiny-moe", ParallelConfig(dp=4, dp_shard=2, ep=2, zero=3, precision="bf16")),
    pytest.param("llama3-8b", ParallelConfig(dp=8, dp_shard=4, tp=2, pp=2, micro_batches=2,
                                             zero=1, sequence_parallel=True, precision="bf16"),
                 marks=pytest.mark.slow),  # 73 s under load
], ids=["moe-ep2-zero3", "8b-dp8(4s×2r)-tp2-pp2-zero1"])
def test_dry_run_of_distinct_ranks_matches_the_ledger(tmp_path, model, par):
    """The dry run (meta tensors, every collective counted per (group, op)) of the distinct
    ranks: model states, storages, bytes per group and op, ZeRO buffers equal the ledger's."""
    from fived.config import TrainConfig
    from fived.train.dryrun import distinct_ranks, dry_run

    m = preset(model)
    train = TrainConfig(global_batch=16)
    out = dry_run(m, par, train, distinct_ranks(par), out_path=str(tmp_path / "d.jsonl"),
                  show=False)
    assert verify.compare_record(m, par, train.global_batch, out) == []
    ops = out["traffic_per_rank"][0]["ops"]
    assert any(k.startswith("dp_replicate/all_reduce") for k in ops), ops
