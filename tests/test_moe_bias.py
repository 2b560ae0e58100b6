"""Loss-free load balancing (issue 29, ``balance = "bias"``; docs/expert-parallel.md).

* the update b_e ← b_e + γ · sign(c̄ − c_e) on a hand example;
* parity (fp32, dropless, 5 steps, γ = 0.05 so the bias really moves the routing), against the
  one-rank run on every rank: the bias of every layer after every step bit for bit; losses,
  grad norms, z losses and first-step gradients (1e-5); the routing (tokens per expert, the
  global routed counts) equal but for a score within rounding of a tie (ep2·dp2 ZeRO-3 moves
  one of 8,192 assignments at step 2: the layouts' sums differ in the last bit), and unlike the
  unbiased model's after step 0 (which routes with a zero bias); the measured traffic — the
  counts' all-reduce over ``batch`` included — equal to the ledger's to the byte. Default: ep2;
  ``-m slow``: ep2·tp2, ep2·tp2·SP, ep2·pp2, ep2·dp2 ZeRO-1 and ZeRO-3, ep2·cp2;
* the load gets more even than without balancing (max/mean tokens per expert);
* a skipped step (a NaN gradient) leaves the bias as it was;
* checkpoints keep the bias: resume on the same layout continues bit for bit, on another
  with the same bias, ``fived generate``'s
  model routes with the trained bias; export to Mixtral refuses it;
* the dry run (fake tensors) with the all-reduce stays exact against the ledger;
* bad input: one message naming the field, exit 2, before any rank starts.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch

from fived.config import ConfigError, ParallelConfig, TrainConfig, preset
from fived.model import build_model
from fived.model.moe import bias_layers
from fived.parallel.balance import update_route_bias
from fived.testing import rel_diff, run_ranks, small_train

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import (  # noqa: E402,I001
    bad_moe_config_exits_2, check_parity, one_rank as _one_rank, train_runs)

BASE = preset("qwen3-moe-tiny")
# the pure loss-free setting (no balance loss), a step large enough to move the routing at once
BIAS = replace(BASE, balance="bias", bias_update_rate=0.05, aux_loss_coef=0.0)
NO_BALANCE = replace(BASE, aux_loss_coef=0.0)  # the same model and loss, without the bias
TRAIN = small_train()  # 5 steps
LAYOUTS4 = {
    "ep2-tp2": ParallelConfig(ep=2, tp=2),
    "ep2-tp2-sp": ParallelConfig(ep=2, tp=2, sequence_parallel=True),
    "ep2-pp2": ParallelConfig(ep=2, pp=2, micro_batches=2),
    "ep2-dp2-zero1": ParallelConfig(ep=2, dp=2, zero=1),
    "ep2-dp2-zero3": ParallelConfig(ep=2, dp=2, zero=3),
    "ep2-cp2": ParallelConfig(ep=2, cp=2),  # each cp rank routes half of every sequence
}

_cache: dict = {}


def one_rank(model):
    if model not in _cache:
        _cache[model] = _one_rank(model, TRAIN)
    return _cache[model]


# ------------------------------------------------------------------------ the formula

def test_update_formula_hand_example():
    """E = 4, counts (3, 1, 2, 2): mean 2, so expert 0 (over) falls by γ, expert 1 (under)
    rises by γ, experts 2 and 3 (at the mean) stay; a second layer with (0, 0, 0, 8) moves the
    other way; the weights are untouched."""
    cfg = replace(BASE, experts=4, top_k=2, layers=2, balance="bias")
    net = build_model(cfg, 7)
    layers = bias_layers(net)
    assert [m.layer for m in layers] == [0, 1]
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    update_route_bias(net, torch.tensor([[3, 1, 2, 2], [0, 0, 0, 8]]), 0.25)
    assert layers[0].route_bias.tolist() == [-0.25, 0.25, 0.0, 0.0]
    assert layers[1].route_bias.tolist() == [0.25, 0.25, 0.25, -0.25]
    update_route_bias(net, torch.tensor([[3, 1, 2, 2], [2, 2, 2, 2]]), 0.25)
    assert layers[0].route_bias.tolist() == [-0.5, 0.5, 0.0, 0.0]
    assert layers[1].route_bias.tolist() == [0.25, 0.25, 0.25, -0.25]  # balanced: no step
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())


def test_bias_steers_the_choice_not_the_weights():
    cfg = replace(BASE, experts=4, top_k=1, balance="bias")
    moe = bias_layers(build_model(cfg, 7))[0]
    scores = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    assert moe.select(scores, 1).tolist() == [[0]]
    moe.route_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.35]))
    assert moe.select(scores, 1).tolist() == [[3]]


# ------------------------------------------------------------------------ parity

TIE_SLACK = 2  # per step and layer: one assignment moved from one expert to another


def routing_moved(a, b) -> int:
    """Σ |Δ tokens per expert| of one step (layers × experts), 2 per moved assignment."""
    return max(sum(abs(x - y) for x, y in zip(ra, rb)) for ra, rb in zip(a, b))


def check_bias(out, par, what):
    """Against the one-rank run: every rank's bias of each of its layers after every step, bit
    for bit; losses and first-step gradients (``check_parity``), grad norms, aux and z losses
    (1e-5); the routing (tokens per expert, the bias's global counts) equal but for a score
    within rounding of a tie (``TIE_SLACK``: the layouts' sums differ in the last bit, and the
    bias pulls the contested experts' biased scores together); the routing moved away from the
    unbiased model's; the last step's traffic equals the ledger's to the byte."""
    from fived.ledger import verify

    ref, plain = one_rank(BIAS), one_rank(NO_BALANCE)
    check_parity(out, ref, what)
    hist, plain_hist = ref["ranks"][0]["history"], plain["ranks"][0]["history"]
    for s in out["ranks"]:
        for h, hr in zip(s["history"], hist):
            mine = h["moe"]["route_bias"]
            assert mine, what
            assert mine == {k: hr["moe"]["route_bias"][k] for k in mine}, (what, h["step"])
            assert rel_diff([h["grad_norm"], h["moe"]["z_loss"]],
                            [hr["grad_norm"], hr["moe"]["z_loss"]]) < 1e-5, what
            moved = routing_moved(h["moe"]["tokens_per_expert"], hr["moe"]["tokens_per_expert"])
            assert moved <= TIE_SLACK, (what, h["step"], moved)
            assert routing_moved([h["moe"]["routed"][k] for k in mine],
                                 [hr["moe"]["routed"][k] for k in mine]) <= TIE_SLACK, what
        assert verify.compare_record(BIAS, par, TRAIN.global_batch, s["history"][-1]) == [], what
    # the bias acts: the same routing at step 0 (zero bias), another one after it moved
    assert hist[0]["moe"]["tokens_per_expert"] == plain_hist[0]["moe"]["tokens_per_expert"]
    assert any(routing_moved(h["moe"]["tokens_per_expert"], p["moe"]["tokens_per_expert"]) > 100
               for h, p in zip(hist[1:], plain_hist[1:]))
    assert any(v != 0.0 for b in hist[0]["moe"]["route_bias"].values() for v in b)
    assert ref["losses"][-1] < ref["losses"][0]


def test_bias_ep2_parity():
    par = ParallelConfig(ep=2)
    check_bias(train_runs([(BIAS, par, TRAIN)])[0], par, "ep2")


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS4))
def test_bias_parity_world4(layout):
    if "world4" not in _cache:  # one spawn for every layout
        _cache["world4"] = dict(zip(LAYOUTS4, train_runs(
            [(BIAS, p, TRAIN) for p in LAYOUTS4.values()])))
    check_bias(_cache["world4"][layout], LAYOUTS4[layout], layout)


# ------------------------------------------------------------------------ it balances

def max_over_mean(history, first: int) -> float:
    """Mean over steps ≥ ``first`` and layers of max_e c_e / mean_e c_e (1.0: even)."""
    r = [max(row) * len(row) / sum(row) for h in history[first:]
         for row in h["moe"]["tokens_per_expert"]]
    return sum(r) / len(r)


def test_bias_balances_the_load():
    """qwen3-moe-tiny (8 experts, top-4) without a balance loss collapses onto 4 experts (the
    worst max/mean with top-4 of 8 is 2.0); the bias (γ = 0.003) spreads the load. Steps 30-59,
    measured: 2.00 without, 1.60 with (docs/expert-parallel.md)."""
    from fived.train.trainer import train_rank

    t = small_train(steps=60)
    got = {}
    for name, m in (("none", NO_BALANCE), ("bias", replace(BIAS, bias_update_rate=0.003))):
        s = train_rank(0, 1, m, ParallelConfig(), t, show=False)
        got[name] = max_over_mean(s["history"], 30)
    print(f"max/mean tokens per expert, steps 30-59: no balancing {got['none']:.3f}, "
          f"bias {got['bias']:.3f}")
    assert got["bias"] < got["none"] - 0.2, got


def _skip_step_2(trainer, step):
    if step == 2:
        trainer.engine.owned_grads()[0].view(-1)[0] = float("nan")


def test_a_skipped_step_leaves_the_bias():
    from fived.testing import OnGrads
    from fived.train.trainer import train_rank

    s = train_rank(0, 1, BIAS, ParallelConfig(), TRAIN, show=False, hooks=[OnGrads(_skip_step_2)])
    h = s["history"]
    assert h[2]["skipped"] and not h[1]["skipped"] and not h[3]["skipped"]
    assert h[2]["moe"]["route_bias"] == h[1]["moe"]["route_bias"]
    assert h[3]["moe"]["route_bias"] != h[2]["moe"]["route_bias"]
    assert h[2]["moe"]["routed"]  # the counts were still all-reduced (the traffic is constant)


# ------------------------------------------------------------------------ checkpoints

def _bias_runs(rank: int, world: int, runs: list) -> list[dict]:
    from fived.train.trainer import train_rank

    out = []
    for m, p, t in runs:
        s = train_rank(rank, world, m, p, t, show=False)
        out.append({"losses": s["losses"], "bias": [h["moe"]["route_bias"] for h in s["history"]]})
    return out


def test_checkpoint_keeps_the_bias_and_reshards(tmp_path):
    """Saved after 3 steps at ep2 (ZeRO-1), resumed at pp2 (each stage reads its layers' bias)
    and on one rank: the last 2 steps' losses and biases equal the straight run's bit for bit;
    the checkpoint holds each layer's bias once; ``fived generate``'s model routes with it."""
    from fived.checkpoint.convert import CheckpointSource
    from fived.checkpoint.storage import read_manifest
    from fived.comm.ops import Traffic
    from fived.infer.model import inference_model
    from fived.ranks.grid import Grid

    d = tmp_path / "ck"
    ep2 = ParallelConfig(ep=2, zero=1)
    straight, _ = run_ranks(_bias_runs, 2, [(BIAS, ep2, TRAIN),
                                            (BIAS, ep2, replace(TRAIN, save_dir=str(d),
                                                                stop_after=3))])[0]
    step = d / "step-000003"
    rest = replace(TRAIN, resume=str(step))
    ranks = run_ranks(_bias_runs, 2, [(BIAS, ep2, rest),
                                      (BIAS, ParallelConfig(pp=2, micro_batches=2), rest)])
    same, pp2, pp2_last = ranks[0][0], ranks[0][1], ranks[1][1]
    one = _bias_runs(0, 1, [(BIAS, ParallelConfig(), rest)])[0]
    assert same == {k: v[3:] for k, v in straight.items()}  # the same layout: bit for bit
    assert sorted(pp2["bias"][0]) == [0, 1] and sorted(pp2_last["bias"][0]) == [2, 3]
    for what, got in (("pp2 stage 0", pp2), ("pp2 stage 1", pp2_last), ("one rank", one)):
        assert rel_diff(got["losses"], straight["losses"][3:]) < 1e-5, what
        assert got["bias"] == [{k: w[k] for k in g} for g, w in zip(got["bias"],
                                                                   straight["bias"][3:])], what

    man = read_manifest(step)
    keys = sorted(k for k in man["tensors"] if k.startswith("buffer."))
    assert keys == [f"buffer.layers.{i}.block_sparse_moe.route_bias" for i in range(4)]
    grid = Grid.from_config(ParallelConfig(), 0).connect(Traffic())
    model = inference_model(BIAS, grid, CheckpointSource(step, man), "cpu")
    saved = straight["bias"][2]  # the bias after step 3 (index 2)
    assert {m.layer: m.route_bias.tolist() for m in bias_layers(model)} == saved
    # the bias changes what it generates from: the logits with a zeroed bias differ
    x = torch.randint(0, BIAS.vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16)
    with torch.no_grad():
        a = model(x, pos)
        for m in bias_layers(model):
            m.route_bias.zero_()
        b = model(x, pos)
    assert not torch.equal(a, b)


def test_export_to_mixtral_refuses_the_bias():
    from fived.checkpoint.hf import hf_config

    with pytest.raises(ConfigError) as e:
        hf_config(BIAS)
    assert len(e.value.problems) == 1 and "balance" in e.value.problems[0]


# ------------------------------------------------------------------------ dry run, bad input

def test_dry_run_with_the_bias_matches_the_ledger():
    """ep2·dp2·pp2 (ZeRO-1): the counts' all-reduce over batch (n = 4, 2 layers per stage) is
    on the fake wire and in the ledger, to the byte, per group and per (group, op)."""
    from fived.ledger import traffic, verify
    from fived.train.dryrun import distinct_ranks, dry_run

    par = ParallelConfig(ep=2, dp=2, pp=2, micro_batches=2, zero=1)
    train = TrainConfig(global_batch=8)
    out = dry_run(BIAS, par, train, distinct_ranks(par), show=False)
    assert verify.compare_record(BIAS, par, 8, out) == []
    for tr in out["traffic_per_rank"]:
        assert tr["ops"]["batch/all_reduce"] == 2 * 3 / 4 * 2 * BIAS.experts * 8
    assert traffic.bias_traffic(BASE, par) == []


def test_bias_validates_with_and_without_the_sequence_wise_loss():
    from fived.config import validate

    for m in (BIAS, replace(BIAS, aux_loss_coef=1e-4), replace(BIAS, router="sigmoid")):
        validate(m, ParallelConfig(ep=2))
    with pytest.raises(ConfigError, match="bias_update_rate"):
        validate(replace(BIAS, bias_update_rate=-0.1), ParallelConfig(ep=2))


@pytest.mark.parametrize("body,field", [
    ('balance = "bias"\nbias_update_rate = -0.1', "bias_update_rate"),
])
def test_bad_bias_config_exits_2(tmp_path, body, field):
    bad_moe_config_exits_2(tmp_path, body, field)
