"""Shared experts (own width, Qwen2-MoE's sigmoid gate) and node-limited routing (issue 29).

* parity (dropless, fp32): a gated shared expert of its own width, and node-limited routing,
  each at ep2, and one model with both under ep2·tp2 with sequence parallelism, ep2·pp2 and
  ep2·dp2 with ZeRO-1 and ZeRO-3, equal the one-rank reference (losses, grad norms, aux losses,
  routing and every first-step gradient, ``check_moe_parity``); ``-m slow`` runs each option
  under every world-4 layout;
* the formulas on one layer: y = routed + σ(w·x) · shared(x); a node-limited token's experts
  lie in its route_top_groups best groups, and the limit changes the routing;
* the ledger: parameter counts and names equal the model's, the dry run is exact;
* bad input: one clear message naming the field, exit 2, before any rank starts.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest
import torch

from fived.config import ConfigError, ParallelConfig, TrainConfig, preset, validate
from fived.model import build_model
from fived.model.moe import moe_layers, route_scores

sys.path.insert(0, os.path.dirname(__file__))
from parity_helpers import SessionRuns, bad_moe_config_exits_2, check_moe_parity  # noqa: E402,I001

BASE = preset("qwen3-moe-tiny")
SHARED = replace(BASE, shared_expert=True, shared_expert_ffn=48, shared_expert_gate=True)
LIMITED = replace(BASE, route_groups=4, route_top_groups=2)
BOTH = replace(SHARED, route_groups=4, route_top_groups=2)
MODELS = {"shared-gated": SHARED, "node-limited": LIMITED}
LAYOUTS4 = {
    "ep2-tp2-sp": ParallelConfig(ep=2, tp=2, sequence_parallel=True),
    "ep2-pp2": ParallelConfig(ep=2, pp=2, micro_batches=2),
    "ep2-dp2-zero1": ParallelConfig(ep=2, dp=2, zero=1),
    "ep2-dp2-zero3": ParallelConfig(ep=2, dp=2, zero=3),
}

runs = SessionRuns()
one_rank = runs.one_rank


# ------------------------------------------------------------------------ parity

def test_each_option_ep2_parity():
    pairs = [(m, ParallelConfig(ep=2)) for m in MODELS.values()]
    for (m, p), out in zip(pairs, runs(pairs)):
        check_moe_parity(out, one_rank(m), (m.name, p.describe()))


def test_both_options_world4_parity():
    pairs = [(BOTH, p) for p in LAYOUTS4.values()]
    for (m, p), out in zip(pairs, runs(pairs)):
        check_moe_parity(out, one_rank(m), p.describe())


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS4))
@pytest.mark.parametrize("name", list(MODELS))
def test_option_parity_matrix(name, layout):
    runs([(MODELS[n], LAYOUTS4[q]) for n in MODELS for q in LAYOUTS4])  # one spawn for all
    m, p = MODELS[name], LAYOUTS4[layout]
    check_moe_parity(runs([(m, p)])[0], one_rank(m), (name, layout))


# ------------------------------------------------------------------------ formulas

def test_shared_expert_gate_formula():
    moe = moe_layers(build_model(SHARED, 7))[0]
    assert moe.shared_expert.gate_proj.weight.shape == (48, SHARED.hidden)
    assert moe.shared_expert_gate.weight.shape == (1, SHARED.hidden)
    x = torch.randn(2, 5, SHARED.hidden)
    with torch.no_grad():
        want = moe.moe(x) + torch.sigmoid(x @ moe.shared_expert_gate.weight.t()) \
            * moe.shared_expert(x)
        assert torch.equal(moe(x), want)
        moe.shared_expert_gate.weight.zero_()  # σ(0): half the shared expert
        assert torch.equal(moe(x), moe.moe(x) + 0.5 * moe.shared_expert(x))


def test_node_limited_routing_stays_in_its_groups():
    torch.manual_seed(0)
    logits = torch.randn(256, BASE.experts)
    free = moe_layers(build_model(BASE, 7))[0]
    limited = moe_layers(build_model(LIMITED, 7))[0]
    scores, _ = route_scores(BASE, logits)
    a, b = free.select(scores, BASE.top_k), limited.select(scores, BASE.top_k)
    per = BASE.experts // LIMITED.route_groups
    groups = [len(set(r)) for r in (b // per).tolist()]
    assert max(groups) <= LIMITED.route_top_groups
    assert max(len(set(r)) for r in (a // per).tolist()) > LIMITED.route_top_groups
    # the chosen groups are the best by the sum of their two best scores
    best = scores.view(256, 4, per).topk(2, -1).values.sum(-1).topk(2, -1).indices
    for row, g in zip((b // per).tolist(), best.tolist()):
        assert set(row) <= set(g)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("ep,groups,top,bound", [(4, 4, 2, 2), (2, 4, 2, 2), (4, 2, 1, 2),
                                                  (8, 8, 8, 4), (4, 0, 0, 4)])
def test_destinations_bound_holds_and_is_reached(ep, groups, top, bound):
    """The ledger's fan-out bound: no token's rows reach more ep ranks, and some reach that
    many (random scores, 4096 tokens)."""
    from fived.ledger.traffic import ep_destinations_bound

    m = replace(BASE, route_groups=groups, route_top_groups=top)
    assert ep_destinations_bound(m, ParallelConfig(ep=ep)) == bound
    torch.manual_seed(1)
    moe = moe_layers(build_model(m, 7))[0]
    scores, _ = route_scores(m, torch.randn(4096, m.experts))
    owners = moe.select(scores, m.top_k) // (m.experts // ep)
    reached = max(len(set(r)) for r in owners.tolist())
    assert reached == bound


# ------------------------------------------------------------------------ ledger

def test_ledger_counts_match_the_model():
    from fived.ledger.params import active_params, param_counts, param_list

    net = build_model(BOTH, 7)
    c = param_counts(BOTH)
    assert c["total"] == sum(p.numel() for p in net.parameters())
    assert [n for n, _, _ in param_list(BOTH, ParallelConfig())] == \
        [n for n, _ in net.named_parameters()]
    routed = BOTH.layers * BOTH.top_k * 3 * BOTH.hidden * BOTH.expert_ffn
    expert = sum(p.numel() for n, p in net.named_parameters() if ".experts." in n)
    assert active_params(BOTH) == c["total"] - expert + routed


@pytest.mark.parametrize("par", [ParallelConfig(ep=2, tp=2, sequence_parallel=True),
                                 ParallelConfig(ep=2, pp=2, micro_batches=2),
                                 ParallelConfig(ep=2, cp=2)],
                         ids=["ep2-tp2-sp", "ep2-pp2", "ep2-cp2"])
def test_dry_run_matches_ledger(par):
    """States, activations and traffic of every distinct rank equal the ledger's exactly."""
    from fived.ledger import verify
    from fived.train.dryrun import distinct_ranks, dry_run

    out = dry_run(BOTH, par, TrainConfig(global_batch=4), distinct_ranks(par), show=False)
    assert verify.compare_record(BOTH, par, 4, out) == []


# ------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("body,field", [
    ("shared_expert_gate = true", "shared_expert_gate"),
    ("shared_expert_ffn = 64", "shared_expert_ffn"),
    ("route_groups = 3\nroute_top_groups = 1", "route_groups"),
    ("route_groups = 4\nroute_top_groups = 5", "route_top_groups"),
    ("route_groups = 4\nroute_top_groups = 1\ntop_k = 4", "route_top_groups"),
])
def test_bad_shared_or_group_config_exits_2(tmp_path, body, field):
    bad_moe_config_exits_2(tmp_path, body, field)


def test_validate_names_each_problem():
    with pytest.raises(ConfigError, match="shared_expert_gate"):
        validate(replace(BASE, shared_expert_gate=True), ParallelConfig())
    with pytest.raises(ConfigError, match="shared expert ffn 47 is not divisible by 2"):
        validate(replace(SHARED, shared_expert_ffn=47), ParallelConfig(tp=2))


def test_roofline_prices_dense_blocks_as_dense():
    """first_dense_layers: the clock runs each block with its own shape (dense blocks as dense),
    the stage's ends once."""
    from fived.ledger import hardware, roofline
    from fived.ledger.params import dense_block_cfg
    from fived.ledger.planner import rank_compute

    m = replace(preset("mixtral-8x7b"), first_dense_layers=4)
    par, hw, clock = ParallelConfig(tp=2, ep=2), hardware.get("h100-sxm"), roofline.ClockOptions()
    got = rank_compute(m, par, hw, 1, 0, clock=clock)
    dense = roofline.micro_batch_times(dense_block_cfg(m), par, 1, hw, 4, True, True, clock)
    moe = roofline.micro_batch_times(m, par, 1, hw, m.layers - 4, False, False, clock)
    for k in got:
        assert got[k] == pytest.approx(dense[k] + moe[k], rel=1e-12), k
    all_moe = roofline.micro_batch_times(m, par, 1, hw, m.layers, True, True, clock)
    assert got["fwd"] != pytest.approx(all_moe["fwd"], rel=1e-3)


@pytest.mark.parametrize("name,total,active", [("qwen3-30b-a3b", 30.5e9, 3.3e9),
                                               ("qwen3-235b-a22b", 235e9, 22e9),
                                               ("deepseek-moe-16b", 16.4e9, 2.8e9)])
def test_published_moe_presets(name, total, active):
    """The presets' parameter counts: the ledger's equal the model built on meta, and both are
    what the publishers state (Qwen3 report: 30.5B/3.3B, 235B/22B; DeepSeekMoE: 16.4B/2.8B) to
    their rounding: the total within 0.5 %, the active within 2 % (3.35B is "3.3B")."""
    from fived.ledger.params import active_params, param_counts

    m = preset(name)
    with torch.device("meta"):
        from fived.model.llama import Transformer

        built = sum(p.numel() for p in Transformer(m).parameters())
    assert param_counts(m)["total"] == built
    assert abs(built / total - 1) < 0.005
    assert abs(active_params(m) / active - 1) < 0.02
